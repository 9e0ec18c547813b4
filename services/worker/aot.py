"""Ahead-of-time GPU compilation of every kernel specialisation a candidate launches,
on any backend.

Triton's interpreter (the cpu backend) runs kernel bodies as Python, so it accepts
code a GPU compiler refuses: ``break``, calls of Python helpers, unsupported indexing,
block sizes whose shared memory no GPU has, parameters a GPU's ``@triton.jit`` refuses.
:func:`specs` turns the launches of every call the verifier records (each trial, each
size, the declared shapes, the dry run at the task's own sizes, every autotune config)
into :class:`CompileSpec` s, keyed by what the compiler sees, so a specialisation that
repeats is compiled once; a launch a GPU could not even make (an argument with no GPU
type, a grid beyond the target's limits) is a problem the verdict names. The
``compile`` child (:func:`run_compile`, forked from a server with Triton's compiler,
not its interpreter) loads every ``@triton.jit`` function of the candidate's kernel
module as a GPU's ``import`` would (:func:`load_kernels`), then compiles each spec with
``triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", cc,
32))`` (``GPUTarget("hip", "gfx942", 64)`` for an AMD target; a spec names its
target, so one child compiles for the request's GPU and the extra targets), which needs
no GPU, reads the compiler's facts (registers, spills, occupancy:
:mod:`services.worker.gpu_facts`) and checks the compiled kernel's shared memory and
threads against the target's limits (:mod:`services.worker.targets`). Results are cached by
:attr:`CompileSpec.key` (kernel source, specialisation, options, target). On the cpu
backend the compile child comes from the same fork server as the others, which
imported Triton for its interpreter; :func:`compile_mode` turns that back.

Signatures follow Triton 3.9's own specialisation of launch arguments
(``triton.runtime.jit.create_function_from_signature``, ``native_specialize_impl``):
a tensor is ``*<dtype>``, an int ``i32``/``u32``/``i64``/``u64`` by value and ``1`` a
``constexpr``, a float ``fp32``, a bool ``u1``, None a ``constexpr``, a tuple the tuple
of its items' types; anything else (a list, a dict, a complex, a str or a torch dtype
for a parameter that is not ``tl.constexpr``) makes a GPU launch raise TypeError.
Divisibility attributes are not given (they change code generation, not what compiles).
"""

from __future__ import annotations

import ast
import asyncio
import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any

from services.sandbox import values
from services.worker.targets import MAX_GRID, GpuTarget

# Triton's default launch options (triton/backends/nvidia/compiler.py CUDAOptions).
_DEFAULT_OPTIONS = {"num_warps": 4, "num_stages": 3, "num_ctas": 1}
_OPTION_NAMES = ("num_warps", "num_stages", "num_ctas", "maxnreg")


@dataclass(frozen=True)
class CompileSpec:
    """One specialisation: ``kernel`` (name), ``signature`` (parameter -> ``*fp32``,
    ``i32``, ``i64``, ``fp32``, ``u1``, ``constexpr``, or a tuple of those for a tuple
    argument), ``constexprs`` (``(path, value)``: a path is the parameter's name, then
    the indexes into a tuple argument), ``options`` (``num_warps`` ...), ``target`` and
    the module ``source_sha``. ``where`` names the launch (for messages): the call, its
    sizes and config."""

    kernel: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, Any], ...]
    options: tuple[tuple[str, int], ...]
    target: str
    capability: int
    source_sha: str
    where: str = ""
    body: str = ""
    arch: str = ""

    @property
    def key(self) -> str:
        """Digest of what the compiler sees: the kernel (its definition's digest where
        known, so same-bodied kernels of one module share a compile; else its name), the
        specialisation, options, target (``arch``, an AMD target's ``gfx942``, beside the
        capability) and the module."""
        parts = [self.body or self.kernel, self.signature, self.constexprs,
                 self.options, self.capability, self.source_sha]
        body = json.dumps(parts + ([self.arch] if self.arch else []),
                          sort_keys=True, default=str)
        return hashlib.sha256(body.encode()).hexdigest()[:32]

    def wire(self) -> dict[str, Any]:
        return {"key": self.key, "kernel": self.kernel, "signature": dict(self.signature),
                "constexprs": [[list(path), value] for path, value in self.constexprs],
                "options": dict(self.options), "capability": self.capability,
                "where": self.where, "target": self.target}


def _int_type(value: int) -> str:
    """Triton 3.9's type of an int argument (its native specialisation): i32 in
    [-2**31, 2**31), i64 in [-2**63, 2**63), u64 in [2**63, 2**64).

    Raises:
        NoGpuType: beyond those (a GPU launch raises there).
    """
    if -2**31 <= value < 2**31:
        return "i32"
    if -2**63 <= value < 2**63:
        return "i64"
    if 0 <= value < 2**64:
        return "u64"
    raise NoGpuType(f"the int {value}, beyond 64 bits, which has no GPU type")


_TRITON_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64",
                 "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64", "uint8": "u8",
                 "uint16": "u16", "uint32": "u32", "uint64": "u64", "bool": "i1",
                 "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5"}
# Encoded values (services.sandbox.values) a GPU launch cannot pass, by tag.
_UNTYPED_TAGS = {"c": "a complex number", "dtype": "a torch dtype", "device": "a torch device",
                 "mf": "a torch memory format", "layout": "a torch layout"}


class NoGpuType(Exception):
    """A launch argument (or an item of a tuple argument) a GPU launch of Triton 3.9
    cannot specialise: its message says what the value is."""


def _arg_type(value: Any, path: tuple[Any, ...], constants: list[tuple[Any, Any]]) -> Any:
    """The signature type of one encoded launch argument at ``path`` (its name, then
    tuple indexes), as ``triton.runtime.jit`` specialises it on a GPU; constexpr items
    are appended to ``constants`` as ``(path, value)``.

    Raises:
        NoGpuType: the value has no GPU type.
    """
    if isinstance(value, dict) and value.get(values.TAG) == "T":
        name = _TRITON_TYPES.get(str(value.get("d")))
        if name is None:
            raise NoGpuType(f"a tensor of dtype {value.get('d')}, which Triton has no pointer "
                            "type for")
        return f"*{name}"
    if isinstance(value, dict) and value.get(values.TAG) == "tuple":
        return tuple(_arg_type(item, (*path, i), constants)
                     for i, item in enumerate(value.get("v") or []))
    if value is None or (isinstance(value, dict) and value.get(values.TAG) == "tl") or (
            isinstance(value, int) and not isinstance(value, bool) and value == 1):
        # None and tl dtypes are constexprs; an int equal to 1 is specialised to one.
        constants.append((path, value))
        return "constexpr"
    if isinstance(value, bool):
        return "u1"
    if isinstance(value, int):
        return _int_type(value)
    if isinstance(value, float):
        return "fp32"
    if isinstance(value, str):
        raise NoGpuType("a str, which a GPU launch passes only to a tl.constexpr parameter")
    if isinstance(value, list):
        raise NoGpuType("a list, which has no GPU type (Triton specialises tuples, not lists)")
    if isinstance(value, dict):
        raise NoGpuType(_UNTYPED_TAGS.get(str(value.get(values.TAG)), "a dict") +
                        ", which has no GPU type")
    raise NoGpuType(f"a {type(value).__name__}, which has no GPU type")


def specs(launches: list[tuple[str, dict[str, Any]]], constexpr_params: dict[str, set[str]],
          target: GpuTarget, source_sha: str, bodies: dict[str, str] | None = None,
          ) -> tuple[list[CompileSpec], list[str]]:
    """The specialisations of ``launches`` (``(where, launch event)``; every autotune
    config's arguments each), deduplicated, and the problems of launches no GPU could
    make, one message each naming the kernel, where it was launched, what and why: an
    argument with no GPU type (:class:`NoGpuType`), a grid beyond the target's limits
    (x < 2**31, y and z < 65536: CUDA C++ Programming Guide, technical specifications).

    ``constexpr_params``: kernel name -> its ``tl.constexpr`` parameters;
    ``bodies``: kernel name -> digest of its definition, name aside (both
    :class:`services.worker.kernel_source.KernelModule`). Kernels of the module with
    the same digest launched with the same specialisation are one spec, the first
    launched one's (a network's layers: GoogLeNet's 57 convolutions were 31 compiles).
    """
    found: dict[str, CompileSpec] = {}
    problems: list[str] = []
    for where, event in launches:
        tune = event.get("autotune")
        runs = (tune.get("variants") or [event]) if isinstance(tune, dict) else [event]
        for number, run in enumerate(runs):
            label = where + (f", config {number}" if len(runs) > 1 else "")
            kernel = str(event.get("launch"))
            constexpr = constexpr_params.get(kernel, set())
            signature: list[tuple[str, Any]] = []
            constants: list[tuple[Any, Any]] = []
            problem = None
            for name, value in (run.get("args") or {}).items():
                if name in constexpr:
                    signature.append((name, "constexpr"))
                    constants.append(((name,), value))
                    continue
                try:
                    signature.append((name, _arg_type(value, (name,), constants)))
                except NoGpuType as exc:
                    problem = (f"the Triton kernel {kernel} cannot be launched on a GPU "
                               f"at {label}: argument '{name}' is {exc}; a GPU "
                               "launch raises TypeError there (pass numbers, tensors, or "
                               "tuples of them)")
                    break
            if problem:
                problems.append(problem)
            grid = run.get("grid") or [1]
            over = [f"{axis}={g}" for axis, g, top in zip("xyz", grid, MAX_GRID, strict=False)
                    if not isinstance(g, int) or g > top]
            if over:
                problems.append(f"grid of {kernel} at {label} exceeds the target's limits: "
                                f"{', '.join(over)} (x < 2**31, y and z < 65536)")
            if problem:
                continue
            options = {**_DEFAULT_OPTIONS, **{k: int(v) for k, v in (run.get("options") or {}).items()
                                              if k in _OPTION_NAMES and isinstance(v, int)}}
            spec = CompileSpec(kernel=kernel, signature=tuple(signature),
                               constexprs=tuple(constants), options=tuple(sorted(options.items())),
                               target=target.name, capability=target.capability,
                               source_sha=source_sha, where=label,
                               body=(bodies or {}).get(kernel, ""),
                               arch=target.gfx if target.backend == "hip" else "")
            found.setdefault(spec.key, spec)
    return list(found.values()), problems


_WARM_KERNEL = (
    "import triton.language as tl\n\n\n"
    "def warm_kernel(x_ptr, n, BLOCK: tl.constexpr):\n"
    "    offs = tl.arange(0, BLOCK)\n"
    "    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1.0, mask=offs < n)\n")


def warm_up() -> None:
    """Fork-server warm-up: one tiny compile per vendor, so that every compile child
    starts with LLVM and both backends initialised (measured here: 1.3 s for the first
    compile in a process, 0.1-0.2 s for the next ones). The kernel is wrapped as a JITFunction by hand: the server may
    have imported Triton for its interpreter, whose ``@triton.jit`` does not compile."""
    import importlib.util
    import os
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    with tempfile.TemporaryDirectory() as tmp:
        # The server's own cache, gone with the warm-up: children have theirs.
        previous = os.environ.get("TRITON_CACHE_DIR")
        os.environ["TRITON_CACHE_DIR"] = os.path.join(tmp, "cache")
        path = os.path.join(tmp, "warm_kernel.py")
        with open(path, "w") as f:
            f.write(_WARM_KERNEL)
        spec = importlib.util.spec_from_file_location("aikg_warm_kernel", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        try:
            # Both vendors' backends (the extra target compiles for the other one), and
            # cuobjdump's first run, which reads the compiler's facts.
            for target in (GPUTarget("cuda", 90, 32), GPUTarget("hip", "gfx942", 64)):
                compiled = triton.compile(
                    ASTSource(JITFunction(module.warm_kernel),
                              {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                              constexprs={"BLOCK": 16}),
                    target=target, options={"num_warps": 1})
                if target.backend == "cuda":
                    from services.worker.gpu_facts import cubin_resources

                    cubin_resources(compiled.asm["cubin"])
        finally:
            if previous is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = previous


def compile_mode() -> int:
    """Turn Triton's interpreter off in this (compile) child: the standard library's
    ``@triton.jit`` functions (``tl.sigmoid``, ``tl.softmax`` ...), made interpreted when
    the fork server imported Triton for the interpreter, become JITFunctions again so
    kernels that call them compile. Returns how many were converted."""
    import sys

    import triton
    from triton.runtime import interpreter, jit

    triton.knobs.runtime.interpret = False
    count = 0
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("triton.language"):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, interpreter.InterpretedFunction):
                setattr(module, attr, jit.JITFunction(value.fn, **value.kwargs))
                count += 1
    return count


def _decode_constant(value: Any) -> Any:
    if isinstance(value, dict) and value.get(values.TAG) == "tl":
        return values.decode(value, lambda ref: ref)
    return value


def _typed(value: Any) -> Any:
    """A signature type as Triton takes it: msgpack turned tuple types into lists."""
    return tuple(_typed(v) for v in value) if isinstance(value, (list, tuple)) else value


def compile_one(module: Any, spec: dict[str, Any], target: GpuTarget) -> dict[str, Any]:
    """Compile one :meth:`CompileSpec.wire` dict for ``target`` (NVIDIA or AMD:
    :func:`services.worker.gpu_facts.compile_for`); returns a :class:`CompileResult`'s
    fields with the compiler's facts (:func:`services.worker.gpu_facts.facts_of`:
    registers, spills, occupancy; a kernel over the target's shared memory or thread
    limits, or of which no block fits on an SM, is not ``ok``). An allocation refused
    names the child's address-space limit. Runs in the compile child."""
    from services.sandbox.child import memory_note, out_of_memory
    from services.worker import gpu_facts

    started = time.perf_counter()
    fn = getattr(module, spec["kernel"], None)
    if fn is None:
        return {"key": spec["key"], "ok": False, "target": target.name,
                "error": f"{spec['kernel']} is not a module-level @triton.jit function"}
    constexprs = {}
    for path, value in spec["constexprs"]:
        if path[0] not in fn.arg_names:
            return {"key": spec["key"], "ok": False, "target": target.name,
                    "error": f"TypeError: {spec['kernel']} has no parameter {path[0]!r}"}
        constexprs[(fn.arg_names.index(path[0]), *path[1:])] = _decode_constant(value)
    signature = {k: _typed(v) for k, v in spec["signature"].items()}
    options = dict(spec["options"])
    try:
        compiled = gpu_facts.compile_for(fn, signature, constexprs, options, target)
    except Exception as exc:  # noqa: BLE001 - the compiler's own errors, of many types
        text = f"{type(exc).__name__}: {exc}"[:4000]
        if out_of_memory(exc):
            text += memory_note()
        return {"key": spec["key"], "ok": False, "error": text, "target": target.name,
                "seconds": time.perf_counter() - started}
    shared = int(getattr(compiled.metadata, "shared", 0) or 0)
    warps = int(getattr(compiled.metadata, "num_warps", options.get("num_warps", 4)))
    try:
        facts = gpu_facts.facts_of(compiled, target)
    except Exception as exc:  # noqa: BLE001 - a tool that failed: the compile stands
        facts = None
        facts_error = f"{type(exc).__name__}: {exc}"[:400]
    if facts is not None:
        return {"key": spec["key"], "ok": facts.ok, "error": facts.error,
                "shared_bytes": facts.shared_bytes, "num_warps": facts.num_warps,
                "seconds": time.perf_counter() - started, "target": target.name,
                "registers": facts.registers, "spill_bytes": facts.spill_bytes,
                "occupancy_warps": facts.occupancy_warps, "max_warps": facts.max_warps,
                "limiter": facts.limiter}
    error = gpu_facts.launch_error(target, shared, warps)
    return {"key": spec["key"], "ok": not error, "error": error, "shared_bytes": shared,
            "num_warps": warps, "seconds": time.perf_counter() - started,
            "target": target.name, "facts_error": facts_error}


def _jit_functions(source: str) -> list[tuple[str, int, int]]:
    """``(name, first line, last line)`` of every decorated module-level function of a
    kernel module (:mod:`services.worker.kernel_source` keeps only ``@triton.jit``
    ones), its decorators included."""
    tree = ast.parse(source)
    return [(node.name, min([d.lineno for d in node.decorator_list] + [node.lineno]),
             node.end_lineno or node.lineno)
            for node in tree.body if isinstance(node, ast.FunctionDef) and node.decorator_list]


def load_kernels(path: str, target: str) -> Any:
    """Import the kernel module at ``path`` with Triton's GPU ``@triton.jit``, as a GPU
    machine's ``import`` of the candidate would, and parse each kernel's source as the
    compiler does: every ``@triton.jit`` function, launched or not. Runs in the compile
    child (after :func:`compile_mode`).

    Raises:
        services.sandbox.child.JobFailure: (stage ``compile``) a function could not be
            loaded or parsed; the message names it and ``target``.
    """
    from triton.runtime.jit import JITFunction

    from services.sandbox.child import JobFailure, failure_of, load_module, location

    with open(path) as f:
        functions = _jit_functions(f.read())

    def named(line: int | None) -> str:
        for name, first, last in functions:
            if line is not None and first <= line <= last:
                return f"the Triton kernel {name}"
        return "the candidate's kernel module"

    try:
        module = load_module("aikg_candidate_kernels", path)
    except Exception as exc:  # noqa: BLE001 - a decorator's error, of any type
        where = location(exc, path)
        line = int(where.rsplit(" ", 1)[1]) if where else None
        raise JobFailure(failure_of("compile", f"{named(line)} cannot be loaded for {target} "
                                    "(importing the candidate on a GPU would fail, launched "
                                    "or not): @triton.jit", exc, path)) from None
    for name, first, _ in functions:
        fn = getattr(module, name, None)
        try:
            if not isinstance(fn, JITFunction):
                raise TypeError(f"{name} is a {type(fn).__name__} once loaded, not a "
                                "JITFunction")
            fn.parse()
        except Exception as exc:  # noqa: BLE001 - whatever parsing raises
            raise JobFailure(failure_of("compile", f"the Triton kernel {name} (candidate.py "
                                        f"line {first}) cannot be parsed for {target}: "
                                        "loading it", exc)) from None
    return module


def run_compile(spec: Any, channel: Any) -> None:
    """The compile child: load every kernel of the module at ``spec.candidate_path``
    (:func:`load_kernels`), compile the spec's ``compile_specs`` for its
    ``compile_target`` (:class:`~services.worker.wire.ChildParams`) and send
    :class:`~services.worker.wire.Compiled`. Each spec's compile is announced first (a
    Progress frame), so a child that dies names what it was compiling."""
    from services.sandbox.wire import Progress
    from services.worker.targets import target_for
    from services.worker.wire import Compiled, CompileResult, params_of

    compile_mode()
    params = params_of(spec)
    target = target_for(params.compile_target)
    where = f"{target.sm} ({target.name})"
    channel.send(Progress(phase=f"loading the candidate's kernels for {where}"))
    module = load_kernels(spec.candidate_path, where)
    results = []
    for s in params.compile_specs:
        # A spec may name another target than the request's (the extra targets).
        this = target_for(s.get("target") or params.compile_target, default=target.name)
        channel.send(Progress(phase=f"compiling the Triton kernel {s['kernel']} for "
                              f"{this.sm} ({this.name}) ({s.get('where') or 'a launch'})"))
        results.append(CompileResult(**compile_one(module, s, this)))
    channel.send(Compiled(results=results))


# ------------------------------------------------------------ the worker's side

# Wall-clock limit of one compile child, seconds (its CPU time is the setting
# sandbox_compile_cpu_s).
COMPILE_WALL_S = 300.0


@dataclass(frozen=True)
class CompileFailure:
    """Why a compile child gave no results: ``stage`` (``compile``: the candidate's
    kernels, or a child that died, hung or hit its limits; ``infrastructure``: the
    worker could not start it), ``message`` for the verdict and ``log``."""

    stage: str
    message: str
    log: str = ""


async def compile_in_child(sandbox: Any, spec: Any, count: int,
                           wall_s: float = COMPILE_WALL_S) -> tuple[list[Any], CompileFailure | None]:
    """Spawn the compile child for ``spec`` (a :class:`~services.sandbox.wire.ChildSpec`
    of ``count`` compile specs) in ``sandbox`` and read its results: ``(results,
    None)``, or ``([], failure)`` when the child gave none. Only a child the worker
    could not start (the fork server is gone) is ``infrastructure``; a child that
    failed, died, sent frames it should not, or ran past ``wall_s`` is ``compile``,
    its limits named (it runs only the candidate's kernel module and the compiler)."""
    from services.sandbox import wire
    from services.sandbox.channel import describe_exit
    from services.sandbox.errors import ForgedFrame, PoolBroken, ProtocolError
    from services.worker.wire import Compiled

    try:
        run = await sandbox.spawn(spec, 64 << 20)
    except PoolBroken as exc:
        return [], CompileFailure("infrastructure", f"the GPU compile check could not start "
                                  f"its child (the worker's sandbox: {exc}); nothing was "
                                  "compiled")
    phase = "starting"
    limits = "; ".join(f"{k.replace('_', ' ')} {v}" for k, v in spec.limit_notes.items())
    try:
        async with asyncio.timeout(wall_s):
            while True:
                frame = await run.frame()
                if isinstance(frame, wire.Progress):
                    phase = frame.phase
                elif isinstance(frame, Compiled):
                    if len(frame.results) != count:
                        return [], CompileFailure("compile", f"the GPU compile child sent "
                                                  f"{len(frame.results)} results for {count} "
                                                  f"kernel specialisations ({phase})")
                    return list(frame.results), None
                elif isinstance(frame, wire.Failure):
                    stage = "infrastructure" if frame.stage == "infrastructure" else "compile"
                    return [], CompileFailure(stage, frame.message, frame.traceback)
                elif frame is None:
                    status = await run.wait(5.0)
                    how = describe_exit(status)
                    how = f"was {how}" if how.startswith("killed") else how
                    return [], CompileFailure("compile", f"the GPU compile child {how} while "
                                              f"{phase} (its limits: {limits})",
                                              run.output(16 << 10))
    except TimeoutError:
        return [], CompileFailure("compile", f"the GPU compile did not finish within "
                                  f"{wall_s:g} s (while {phase}); its process was killed "
                                  f"(its limits: {limits})")
    except (ForgedFrame, ProtocolError) as exc:
        return [], CompileFailure("compile", f"the GPU compile child sent malformed frames "
                                  f"while {phase}: {exc}")
    finally:
        await run.close()
