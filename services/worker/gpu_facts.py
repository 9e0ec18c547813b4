"""What a GPU compiler says of a compiled Triton kernel, read without a GPU: registers,
spills, shared memory, and the occupancy they allow on the target.

:func:`facts_of` reads a kernel compiled with ``triton.compile(..., target=GPUTarget(...))``:

- NVIDIA (``cuda``): the cubin through the ``cuobjdump --dump-resource-usage`` that
  Triton's wheel bundles (``triton/backends/nvidia/bin``; ``TRITON_CUOBJDUMP_PATH``
  overrides), which prints per function ``REG:`` (registers per thread), ``STACK:``
  (the stack frame, bytes per thread: where ptxas spills registers), ``SHARED:``
  (static shared memory) and ``LOCAL:``. Triton's shared memory is dynamic: the
  metadata's ``shared`` is added. ``CompiledKernel.n_regs``/``n_spills`` need a driver,
  so they are not used.
- AMD (``hip``): the AMDGPU code object metadata LLVM writes into ``asm["amdgcn"]``
  (the fields of Triton's ``triton/backends/amd/compiler.py`` ``make_amdgcn`` output):
  ``.vgpr_count``, ``.agpr_count``, ``.sgpr_count``, ``.vgpr_spill_count``,
  ``.private_segment_fixed_size`` (scratch bytes per lane: spills and stack),
  ``.group_segment_fixed_size`` (static LDS), and LLVM's own ``; Occupancy:`` (waves
  per SIMD) and ``; TotalNumVgprs:`` (arch VGPRs and AGPRs, one file on CDNA2/3).

:func:`occupancy` turns registers, shared memory and warps per block into resident
warps per SM (waves per CU) against the limits of
:data:`services.worker.targets.OCCUPANCY`, as the CUDA Occupancy Calculator does:
blocks per SM = min(register file / registers per block (allocated in units of 256
per warp), shared memory per SM / (shared per block + 1 KB reserved), max warps /
warps per block, max blocks); on AMD a workgroup's waves spread over the CU's 4
SIMDs, each holding min(8, 512 / VGPRs (in blocks of 8)) waves, and LDS is 64 KiB per
CU. The resource that binds first is the ``limiter``. A kernel none of whose blocks
fit cannot launch.

:func:`config_ok` compiles one kernel specialisation in this process (results cached
in memory and, when ``AIKG_GPU_FACTS_CACHE_DIR`` names a directory, on disk, keyed by
a digest of every input) so that a code generator can drop configurations that spill
or cannot launch before it emits them.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, fields
from typing import Any

from services.worker.targets import MAX_THREADS_PER_BLOCK, GpuTarget, target_for

# A config whose spills reach this many bytes per thread is said to spill heavily (a
# few spilled registers cost little; hundreds of bytes per thread put local-memory
# traffic beside every tile). Any spill at all is named in a verdict's notes.
HEAVY_SPILL_BYTES = 256


@dataclass(frozen=True)
class KernelFacts:
    """What the compiler says of one kernel specialisation for one target.

    ``target`` (a :data:`services.worker.targets.TARGETS` name), ``arch`` (``sm_90``,
    ``gfx942``), ``kernel`` (function name), ``registers`` (per thread: NVIDIA's REG,
    AMD's VGPRs + AGPRs), ``sgprs`` (AMD scalar registers per wave; 0 on NVIDIA),
    ``spill_bytes`` (per thread: NVIDIA's stack frame plus local memory, AMD's private
    segment; > 0 means registers spilled), ``spilled_registers`` (AMD: VGPRs + SGPRs
    spilled; NVIDIA: ``spill_bytes`` // 4), ``shared_bytes`` (shared memory / LDS per
    block, bytes), ``num_warps`` (warps or waves per block), ``occupancy_warps``
    (resident warps per SM, waves per CU on AMD), ``max_warps`` (the arch's limit of
    those), ``blocks`` (resident blocks per SM), ``limiter`` (``registers``,
    ``shared``, ``warps``, ``blocks``; what binds first), ``ok`` (it compiled and can
    launch), ``error`` (why not), ``seconds`` (compile and read time).
    """

    target: str
    arch: str = ""
    kernel: str = ""
    registers: int = 0
    sgprs: int = 0
    spill_bytes: int = 0
    spilled_registers: int = 0
    shared_bytes: int = 0
    num_warps: int = 0
    occupancy_warps: int = 0
    max_warps: int = 0
    blocks: int = 0
    limiter: str = ""
    ok: bool = True
    error: str = ""
    seconds: float = 0.0

    @property
    def spills(self) -> bool:
        return self.spill_bytes > 0 or self.spilled_registers > 0

    @property
    def heavy_spill(self) -> bool:
        return self.spill_bytes >= HEAVY_SPILL_BYTES

    @property
    def launchable(self) -> bool:
        """It compiled and at least one block fits on an SM."""
        return self.ok and self.blocks > 0

    def usable(self, max_spill_bytes: int = 0) -> bool:
        """Launchable and spilling at most ``max_spill_bytes`` per thread."""
        return self.launchable and self.spill_bytes <= max_spill_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KernelFacts:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def _target(target: GpuTarget | str) -> GpuTarget:
    """A target by name.

    Raises:
        KeyError: ``target`` names none of :data:`services.worker.targets.TARGETS`.
    """
    if isinstance(target, GpuTarget):
        return target
    from services.worker.targets import TARGETS

    if target.lower() not in TARGETS:
        raise KeyError(f"unknown GPU target {target!r}; one of {', '.join(sorted(TARGETS))}")
    return target_for(target)


def occupancy(target: GpuTarget | str, registers: int, shared_bytes: int,
              num_warps: int) -> tuple[int, int, str]:
    """``(resident warps per SM, resident blocks per SM, limiter)`` of a kernel using
    ``registers`` per thread (VGPRs on AMD), ``shared_bytes`` per block and
    ``num_warps`` warps (waves) per block on ``target``; ``(0, 0, limiter)`` when no
    block fits (the limiter names why). Limits and sources:
    :data:`services.worker.targets.OCCUPANCY`."""
    t = _target(target)
    lim = t.occupancy
    warps = max(1, num_warps)
    if t.backend == "hip":
        # Waves of a workgroup are spread over the CU's SIMDs; each SIMD's waves share
        # its 512 VGPRs per lane, allocated in blocks of register_unit.
        per_simd = -(-warps // lim.simds)
        alloc = max(lim.register_unit, -(-max(registers, 1) // lim.register_unit)
                    * lim.register_unit)
        waves_per_simd = min(lim.max_warps // lim.simds, lim.registers // alloc)
        by = {"registers": waves_per_simd // per_simd if registers <= lim.max_registers else 0,
              "warps": (lim.max_warps // lim.simds) // per_simd}
    else:
        per_warp = -(-max(registers, 1) * t.warp_size // lim.register_unit) * lim.register_unit
        by = {"registers": (lim.registers // per_warp) // warps
              if registers <= lim.max_registers else 0,
              "warps": lim.max_warps // warps}
    footprint = shared_bytes + lim.reserved_shared
    by["shared"] = lim.shared // footprint if footprint else lim.max_blocks
    if shared_bytes > t.shared_bytes:
        by["shared"] = 0
    by["blocks"] = lim.max_blocks
    if warps * t.warp_size > MAX_THREADS_PER_BLOCK:
        by["warps"] = 0
    limiter = min(by, key=lambda k: (by[k], ["warps", "blocks", "registers",
                                             "shared"].index(k)))
    blocks = max(0, by[limiter])
    return blocks * warps, blocks, limiter


# ------------------------------------------------------------ reading a compiled kernel

_CUOBJDUMP: list[str] = []


def cuobjdump_path() -> str:
    """The ``cuobjdump`` Triton's wheel bundles (``TRITON_CUOBJDUMP_PATH`` first).

    Raises:
        FileNotFoundError: neither exists.
    """
    if _CUOBJDUMP:
        return _CUOBJDUMP[0]
    import triton

    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                           "cuobjdump")
    for path in (os.environ.get("TRITON_CUOBJDUMP_PATH"), bundled):
        if path and os.access(path, os.X_OK):
            _CUOBJDUMP.append(path)
            return path
    raise FileNotFoundError(f"cuobjdump not found (Triton's wheel: {bundled})")


_RESOURCE = re.compile(r"Function\s+(\S+?):\s*\n\s*REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)"
                       r"\s+LOCAL:(\d+)")


def cubin_resources(cubin: bytes) -> dict[str, dict[str, int]]:
    """``cuobjdump --dump-resource-usage`` of ``cubin``: function name -> ``REG``,
    ``STACK``, ``SHARED``, ``LOCAL`` (registers per thread; bytes).

    Raises:
        RuntimeError: cuobjdump failed or printed no function.
    """
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        run = subprocess.run([cuobjdump_path(), "--dump-resource-usage", f.name],
                             capture_output=True, text=True, timeout=60)
    found = {m.group(1): {"REG": int(m.group(2)), "STACK": int(m.group(3)),
                          "SHARED": int(m.group(4)), "LOCAL": int(m.group(5))}
             for m in _RESOURCE.finditer(run.stdout)}
    if run.returncode or not found:
        raise RuntimeError(f"cuobjdump --dump-resource-usage gave no resource usage "
                           f"(exit {run.returncode}): {(run.stderr or run.stdout)[-400:]}")
    return found


def amdgcn_resources(amdgcn: str) -> dict[str, int]:
    """The AMDGPU metadata of one kernel's assembly: ``vgpr_count``, ``agpr_count``,
    ``sgpr_count``, ``vgpr_spill_count``, ``sgpr_spill_count``,
    ``private_segment_fixed_size``, ``group_segment_fixed_size`` and LLVM's
    ``total_vgprs`` and ``occupancy`` (waves per SIMD); a field missing is absent.
    """
    out: dict[str, int] = {}
    for name in ("vgpr_count", "agpr_count", "sgpr_count", "vgpr_spill_count",
                 "sgpr_spill_count", "private_segment_fixed_size",
                 "group_segment_fixed_size"):
        m = re.search(rf"^\s*\.{name}:\s*(\d+)", amdgcn, re.M)
        if m:
            out[name] = int(m.group(1))
    for name, key in (("TotalNumVgprs", "total_vgprs"), ("Occupancy", "occupancy")):
        m = re.search(rf"^\s*;\s*{name}:\s*(\d+)", amdgcn, re.M)
        if m:
            out[key] = int(m.group(1))
    return out


def launch_error(target: GpuTarget, shared_bytes: int, warps: int) -> str:
    """Why no block of a kernel with ``shared_bytes`` of shared memory (LDS) and
    ``warps`` warps (waves) could launch on ``target`` (its per-block shared memory and
    threads, services/worker/targets.py), or ""."""
    if shared_bytes > target.shared_bytes:
        return (f"OutOfResources: shared memory, required {shared_bytes} bytes, the target "
                f"allows {target.shared_bytes} per block (smaller block sizes or fewer stages "
                "fit)")
    if warps * target.warp_size > MAX_THREADS_PER_BLOCK:
        return (f"OutOfResources: {warps} warps are {warps * target.warp_size} threads per "
                f"block; at most {MAX_THREADS_PER_BLOCK}")
    return ""


def facts_of(compiled: Any, target: GpuTarget | str, seconds: float = 0.0) -> KernelFacts:
    """The :class:`KernelFacts` of ``compiled`` (a ``triton.compiler.CompiledKernel``
    for ``target``), read without a GPU (see the module doc). A kernel whose shared
    memory or threads exceed the target's per-block limits, or of which no block fits
    on an SM, is ``ok=False`` with an ``OutOfResources`` error.

    Raises:
        RuntimeError: the compiled kernel carries none of the facts (cuobjdump failed).
    """
    t = _target(target)
    meta = compiled.metadata
    name = str(getattr(meta, "name", "") or "")
    warps = int(getattr(meta, "num_warps", 4) or 4)
    dynamic = int(getattr(meta, "shared", 0) or 0)
    if t.backend == "hip":
        res = amdgcn_resources(compiled.asm.get("amdgcn", ""))
        registers = res.get("total_vgprs", res.get("vgpr_count", 0) + res.get("agpr_count", 0))
        sgprs = res.get("sgpr_count", 0)
        spill = res.get("private_segment_fixed_size", 0)
        spilled = res.get("vgpr_spill_count", 0) + res.get("sgpr_spill_count", 0)
        shared = dynamic + res.get("group_segment_fixed_size", 0)
    else:
        found = cubin_resources(compiled.asm["cubin"])
        res = found.get(name) or next(iter(found.values()))
        registers, sgprs = res["REG"], 0
        spill = res["STACK"] + res["LOCAL"]
        spilled = spill // 4
        shared = dynamic + res["SHARED"]
    resident, blocks, limiter = occupancy(t, registers, shared, warps)
    error = launch_error(t, shared, warps)
    if not error and blocks == 0:
        error = (f"OutOfResources: no block fits on an SM of {t.sm} ({limiter}: "
                 f"{registers} registers per thread, {shared} bytes of shared memory, "
                 f"{warps} warps)")
    return KernelFacts(target=t.name, arch=t.sm, kernel=name, registers=registers,
                       sgprs=sgprs, spill_bytes=spill, spilled_registers=spilled,
                       shared_bytes=shared, num_warps=warps, occupancy_warps=resident,
                       max_warps=t.occupancy.max_warps, blocks=blocks, limiter=limiter,
                       ok=not error, error=error, seconds=seconds)


def compile_for(fn: Any, signature: dict[str, Any], constexprs: dict[Any, Any],
                options: dict[str, Any], target: GpuTarget) -> Any:
    """``triton.compile`` of the JITFunction ``fn`` for ``target`` (no GPU needed);
    options a backend does not know (``maxnreg`` on AMD) are dropped.

    Raises:
        Exception: the compiler's own errors, of many types.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    opts = dict(options)
    if target.backend == "hip":
        opts.pop("maxnreg", None)
    return triton.compile(ASTSource(fn, signature, constexprs=constexprs),
                          target=GPUTarget(*target.triton_target()), options=opts)


# ------------------------------------------------------------ config_ok

_LOCK = threading.Lock()
_MEMORY: dict[str, KernelFacts] = {}
_MEMORY_ENTRIES = 4096


@contextlib.contextmanager
def compiler_mode():
    """Triton's compiler, not its interpreter, for the duration: with
    ``TRITON_INTERPRET`` on, ``triton.language``'s own ``@triton.jit`` helpers are
    interpreted functions the compiler cannot call; they are made JITFunctions and
    put back afterwards (as is the interpreter setting)."""
    import triton
    from triton.runtime import interpreter, jit

    was = triton.knobs.runtime.interpret
    swapped = []
    if was:
        for name, module in list(sys.modules.items()):
            if module is None or not name.startswith("triton.language"):
                continue
            for attr, value in list(vars(module).items()):
                if isinstance(value, interpreter.InterpretedFunction):
                    setattr(module, attr, jit.JITFunction(value.fn, **value.kwargs))
                    swapped.append((module, attr, value))
    triton.knobs.runtime.interpret = False
    try:
        yield
    finally:
        triton.knobs.runtime.interpret = was
        for module, attr, value in swapped:
            setattr(module, attr, value)


def _digest(*parts: Any) -> str:
    body = json.dumps(parts, sort_keys=True, default=repr)
    return hashlib.sha256(body.encode()).hexdigest()[:40]


def _disk_dir() -> str | None:
    path = os.environ.get("AIKG_GPU_FACTS_CACHE_DIR", "")
    return path or None


def config_ok(kernel_source: str, kernel_name: str, signature: dict[str, str],
              constexprs: dict[str, object], options: dict, target: str) -> KernelFacts:
    """Compile ``kernel_name`` of the module ``kernel_source`` (Python source with
    ``@triton.jit`` kernels) for ``target`` (a :data:`services.worker.targets.TARGETS`
    name: ``h100``, ``sm_90``, ``mi300x``, ``gfx942`` ...) in this process, and return
    its :class:`KernelFacts`; a code generator keeps a config when ``.usable()`` (it
    compiles, a block fits on an SM, nothing spills).

    ``signature``: parameter -> Triton type (``*fp16``, ``i32``, ``fp32``,
    ``constexpr``); ``constexprs``: parameter -> value of each ``constexpr``;
    ``options``: ``num_warps``, ``num_stages`` (, ``num_ctas``, ``maxnreg``). A compile
    error is ``ok=False`` with the error's text, not raised. Results are cached by a
    digest of every argument and the Triton version, in memory and, when
    ``AIKG_GPU_FACTS_CACHE_DIR`` names a directory, as a JSON file there. Costs: a
    small kernel 0.2-3 s, a 256x256 GEMM tile tens of seconds, the first compile of a
    process about a second more (LLVM's start).

    Raises:
        KeyError: ``target`` is not a known target.
    """
    import triton

    t = _target(target)
    key = _digest(kernel_source, kernel_name, signature, constexprs, options, t.name,
                  t.sm, triton.__version__)
    with _LOCK:
        hit = _MEMORY.get(key)
    if hit is not None:
        return hit
    disk = _disk_dir()
    path = os.path.join(disk, f"{key}.json") if disk else None
    if path and os.path.exists(path):
        try:
            with open(path) as f:
                facts = KernelFacts.from_dict(json.load(f))
            _remember(key, facts)
            return facts
        except (OSError, ValueError, TypeError):
            pass
    facts = _compile_source(kernel_source, kernel_name, signature, constexprs, options, t)
    _remember(key, facts)
    if path:
        with contextlib.suppress(OSError):
            os.makedirs(disk, exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(facts.to_dict(), f)
            os.replace(tmp, path)
    return facts


def _remember(key: str, facts: KernelFacts) -> None:
    with _LOCK:
        _MEMORY[key] = facts
        while len(_MEMORY) > _MEMORY_ENTRIES:
            _MEMORY.pop(next(iter(_MEMORY)))


def _compile_source(source: str, kernel_name: str, signature: dict[str, str],
                    constexprs: dict[str, object], options: dict,
                    target: GpuTarget) -> KernelFacts:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="aikg_facts_") as tmp, compiler_mode():
        from triton.runtime.jit import JITFunction

        path = os.path.join(tmp, "kernels.py")
        with open(path, "w") as f:
            f.write(source)
        module_name = f"aikg_facts_{_digest(source)[:16]}"
        try:
            spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            fn = getattr(module, kernel_name, None)
            if fn is None:
                raise NameError(f"{kernel_name} is not defined by the kernel source")
            if not isinstance(fn, JITFunction):
                # Defined under the interpreter: the same function, compiled.
                fn = JITFunction(getattr(fn, "fn", fn))
            # Module globals may hold other interpreted kernels a kernel calls.
            for attr, value in list(vars(module).items()):
                if hasattr(value, "fn") and not isinstance(value, JITFunction) and \
                        type(value).__name__ == "InterpretedFunction":
                    setattr(module, attr, JITFunction(value.fn))
            compiled = compile_for(fn, dict(signature), dict(constexprs), dict(options),
                                   target)
            return facts_of(compiled, target, time.perf_counter() - started)
        except Exception as exc:  # noqa: BLE001 - the compiler's own errors, of many types
            return KernelFacts(target=target.name, arch=target.sm, kernel=kernel_name,
                               ok=False, error=f"{type(exc).__name__}: {exc}"[:4000],
                               num_warps=int(options.get("num_warps", 4)),
                               max_warps=target.occupancy.max_warps,
                               seconds=time.perf_counter() - started)
