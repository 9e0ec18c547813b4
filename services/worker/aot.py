"""Ahead-of-time GPU compilation of every kernel specialisation a candidate launches,
on any backend.

Triton's interpreter (the cpu backend) runs kernel bodies as Python, so it accepts
code a GPU compiler refuses: ``break``, calls of Python helpers, unsupported indexing,
block sizes whose shared memory no GPU has. :func:`specs` turns the launches a plan
and a dry run recorded (at the checked sizes and at the task's own) into
:class:`CompileSpec` s; the ``compile`` child (:func:`run_compile`, forked from a
server with Triton's compiler, not its interpreter) compiles each with
``triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", cc,
32))``, which needs no GPU, and checks the compiled kernel's shared memory and
threads against the target's limits (:mod:`services.worker.targets`). Results are
cached by :attr:`CompileSpec.key` (kernel source, specialisation, options, target).
On the cpu backend the compile child comes from the same fork server as the others,
which imported Triton for its interpreter; :func:`compile_mode` turns that back.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any

from services.sandbox import values
from services.worker.targets import MAX_GRID, MAX_THREADS_PER_BLOCK, WARP_SIZE, GpuTarget

# Triton's default launch options (triton/backends/nvidia/compiler.py CUDAOptions).
_DEFAULT_OPTIONS = {"num_warps": 4, "num_stages": 3, "num_ctas": 1}
_OPTION_NAMES = ("num_warps", "num_stages", "num_ctas", "maxnreg")


@dataclass(frozen=True)
class CompileSpec:
    """One specialisation: ``kernel`` (name), ``signature`` (parameter -> ``*fp32``,
    ``i32``, ``i64``, ``fp32``, ``i1`` or ``constexpr``), ``constexprs`` (name ->
    value), ``options`` (``num_warps`` ...), ``target`` and the module ``source_sha``.
    ``where`` names the launch (for messages): sizes and config."""

    kernel: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, Any], ...]
    options: tuple[tuple[str, int], ...]
    target: str
    capability: int
    source_sha: str
    where: str = ""
    body: str = ""

    @property
    def key(self) -> str:
        """Digest of what the compiler sees: the kernel (its definition's digest where
        known, so same-bodied kernels of one module share a compile; else its name), the
        specialisation, options, target and the module."""
        body = json.dumps([self.body or self.kernel, self.signature, self.constexprs,
                           self.options, self.capability, self.source_sha],
                          sort_keys=True, default=str)
        return hashlib.sha256(body.encode()).hexdigest()[:32]

    def wire(self) -> dict[str, Any]:
        return {"key": self.key, "kernel": self.kernel, "signature": dict(self.signature),
                "constexprs": dict(self.constexprs), "options": dict(self.options),
                "capability": self.capability}


def _int_type(value: int) -> str:
    # triton.runtime.jit.mangle_type: i32 in [-2**31, 2**31), u32 below 2**32, else i64.
    if -2**31 <= value < 2**31:
        return "i32"
    if 0 <= value < 2**32:
        return "u32"
    if -2**63 <= value < 2**63:
        return "i64"
    return "u64"


_TRITON_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64",
                 "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64", "uint8": "u8",
                 "uint16": "u16", "uint32": "u32", "uint64": "u64", "bool": "i1",
                 "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5"}


def _arg_type(value: Any) -> str | None:
    """The signature type of one encoded launch argument (None: not compilable here)."""
    if isinstance(value, dict) and value.get(values.TAG) == "T":
        name = _TRITON_TYPES.get(str(value.get("d")))
        return f"*{name}" if name else None
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return _int_type(value)
    if isinstance(value, float):
        return "fp32"
    if value is None:
        return "constexpr"
    return None


def specs(launches: list[tuple[str, dict[str, Any]]], constexpr_params: dict[str, set[str]],
          target: GpuTarget, source_sha: str, bodies: dict[str, str] | None = None,
          ) -> tuple[list[CompileSpec], list[str]]:
    """The specialisations of ``launches`` (``(where, launch event)``; every autotune
    config's arguments each), deduplicated, and notes on launches that cannot be
    compiled here (a tuple argument, a grid beyond the target's limits ...).

    ``constexpr_params``: kernel name -> its ``tl.constexpr`` parameters;
    ``bodies``: kernel name -> digest of its definition, name aside (both
    :class:`services.worker.kernel_source.KernelModule`). Kernels of the module with
    the same digest launched with the same specialisation are one spec, the first
    launched one's (a network's layers: GoogLeNet's 57 convolutions were 31 compiles).
    """
    found: dict[str, CompileSpec] = {}
    notes: list[str] = []
    for where, event in launches:
        tune = event.get("autotune")
        runs = (tune.get("variants") or [event]) if isinstance(tune, dict) else [event]
        for number, run in enumerate(runs):
            label = where + (f", config {number}" if len(runs) > 1 else "")
            kernel = str(event.get("launch"))
            constexpr = constexpr_params.get(kernel, set())
            signature, constants, problem = [], [], None
            for name, value in (run.get("args") or {}).items():
                if name in constexpr or value is None or isinstance(value, str) or (
                        isinstance(value, dict) and value.get(values.TAG) == "tl"):
                    signature.append((name, "constexpr"))
                    constants.append((name, value))
                    continue
                kind = _arg_type(value)
                if kind is None:
                    problem = f"argument {name} of {kernel} ({label}) has no GPU type here"
                    break
                signature.append((name, kind))
            if problem:
                notes.append(problem)
                continue
            grid = run.get("grid") or [1]
            over = [f"{axis}={g}" for axis, g, top in zip("xyz", grid, MAX_GRID, strict=False)
                    if g > top]
            if over:
                notes.append(f"grid of {kernel} ({label}) exceeds the target's limits: "
                             f"{', '.join(over)} (x < 2**31, y and z < 65536)")
            options = {**_DEFAULT_OPTIONS, **{k: int(v) for k, v in (run.get("options") or {}).items()
                                              if k in _OPTION_NAMES and isinstance(v, int)}}
            spec = CompileSpec(kernel=kernel, signature=tuple(signature),
                               constexprs=tuple(constants), options=tuple(sorted(options.items())),
                               target=target.name, capability=target.capability,
                               source_sha=source_sha, where=label,
                               body=(bodies or {}).get(kernel, ""))
            found.setdefault(spec.key, spec)
    return list(found.values()), notes


_WARM_KERNEL = (
    "import triton.language as tl\n\n\n"
    "def warm_kernel(x_ptr, n, BLOCK: tl.constexpr):\n"
    "    offs = tl.arange(0, BLOCK)\n"
    "    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1.0, mask=offs < n)\n")


def warm_up() -> None:
    """Fork-server warm-up: one tiny compile, so that every compile child starts with
    LLVM initialised (measured here: 1.3 s for the first compile in a process, 0.1-0.2 s
    for the next ones). The kernel is wrapped as a JITFunction by hand: the server may
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
            triton.compile(ASTSource(JITFunction(module.warm_kernel),
                                     {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                                     constexprs={"BLOCK": 16}),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
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


def compile_one(module: Any, spec: dict[str, Any], shared_limit: int) -> dict[str, Any]:
    """Compile one :meth:`CompileSpec.wire` dict; returns a :class:`CompileResult`'s
    fields. Runs in the compile child."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    started = time.perf_counter()
    fn = getattr(module, spec["kernel"], None)
    if fn is None:
        return {"key": spec["key"], "ok": False,
                "error": f"{spec['kernel']} is not a module-level @triton.jit function"}
    constexprs = {k: _decode_constant(v) for k, v in spec["constexprs"].items()}
    options = dict(spec["options"])
    try:
        compiled = triton.compile(ASTSource(fn, dict(spec["signature"]), constexprs=constexprs),
                                  target=GPUTarget("cuda", spec["capability"], WARP_SIZE),
                                  options=options)
    except Exception as exc:  # noqa: BLE001 - the compiler's own errors, of many types
        text = f"{type(exc).__name__}: {exc}"
        return {"key": spec["key"], "ok": False, "error": text[:4000],
                "seconds": time.perf_counter() - started}
    shared = int(getattr(compiled.metadata, "shared", 0) or 0)
    warps = int(getattr(compiled.metadata, "num_warps", options.get("num_warps", 4)))
    error = ""
    if shared > shared_limit:
        error = (f"OutOfResources: shared memory, required {shared} bytes, the target allows "
                 f"{shared_limit} per block (smaller block sizes or fewer stages fit)")
    elif warps * WARP_SIZE > MAX_THREADS_PER_BLOCK:
        error = (f"OutOfResources: {warps} warps are {warps * WARP_SIZE} threads per block; "
                 f"at most {MAX_THREADS_PER_BLOCK}")
    return {"key": spec["key"], "ok": not error, "error": error, "shared_bytes": shared,
            "num_warps": warps, "seconds": time.perf_counter() - started}


def run_compile(spec: Any, channel: Any) -> None:
    """The compile child: compile ``spec.compile_specs`` from the kernel module at
    ``spec.candidate_path`` for ``spec.compile_target`` and send
    :class:`~services.sandbox.wire.Compiled`."""
    from services.sandbox.child import _load_module
    from services.sandbox.wire import Compiled, CompileResult, Progress
    from services.worker.targets import target_for

    compile_mode()
    channel.send(Progress(phase="compiling the kernels for a GPU target"))
    module = _load_module("aikg_candidate_kernels", spec.candidate_path)
    target = target_for(spec.compile_target)
    results = [CompileResult(**compile_one(module, s, target.shared_bytes))
               for s in spec.compile_specs]
    channel.send(Compiled(results=results))
