"""Code that runs inside a sandboxed child: the entry, the helpers role runners share,
and the ``probe`` role.

A child is forked by :mod:`services.sandbox.forkserver` (which has torch and triton
imported already), enters the sandbox (:func:`enter_sandbox`), sets up its backend,
then calls the runner its spec names (``spec.runner``, ``module:function``, from
:mod:`services.sandbox.roles`). The roles and their owners:

* ``probe`` (here): nothing but the sandbox entry and a tiny Triton launch;
  :meth:`Sandbox.start` uses it to learn which isolation steps this machine permits.
* ``reference``, ``candidate``, ``replay``, ``compile``: the worker's verification
  (registered by services/worker/verifier.py).
* ``lower``: the generator's built-in coder on a task (registered by
  services/generator/coders/lowering_role.py).

The child never decides pass or fail: the parent compares what it receives.

The wire format is :mod:`services.sandbox.wire`; the sandbox entry every child runs
first is :mod:`services.sandbox.hardening`.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import random
import statistics
import sys
import time
import traceback
from typing import Any, NoReturn

import torch

from services.sandbox.hardening import enter_sandbox
from services.sandbox.roles import runner_of
from services.sandbox.wire import (
    Channel,
    ChildSpec,
    Done,
    Failure,
    Timing,
    capture_tensor_methods,
)

# A scratch allocation released when a MemoryError is handled, so that the error
# report itself can still be built and sent.
_EMERGENCY_BYTES = 4 << 20
# Exception messages can be megabytes (tensor reprs); the coder needs the start and
# the end (the last line often names the cause). Tracebacks are cut the same way.
_MAX_MESSAGE_CHARS = 2000
_MAX_TRACEBACK_CHARS = 32000


# ---------------------------------------------------------------- job helpers


class JobFailure(Exception):
    """Stop the job and report ``failure``."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.message)
        self.failure = failure


def _load_module(name: str, path: str) -> Any:
    """Import the file at ``path`` as module ``name`` (Triton reads kernel source from it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _location(exc: BaseException, path: str) -> str:
    """``candidate.py line 12``: the innermost traceback frame in ``path``, or ''."""
    line = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == path:
            line = tb.tb_lineno
        tb = tb.tb_next
    return f"{os.path.basename(path)} line {line}" if line else ""


_reserve: list[bytearray] = []
# The spec's limit_notes (services.sandbox.limits), for failures that hit a limit.
_limit_notes: dict[str, str] = {}
def out_of_memory(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is an allocation refused:
    ``MemoryError`` (Python, numpy) or torch's ``DefaultCPUAllocator: can't allocate
    memory`` RuntimeError."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, MemoryError) or (
                isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def memory_note() -> str:
    """What a failure that ran out of address space adds: the limit's setting and value."""
    limit = _limit_notes.get("address_space")
    if limit:
        return (f" (the sandbox's address-space limit {limit} was reached: allocate less "
                "memory, or raise the setting)")
    return " (the sandbox's address-space limit was reached; allocate less memory)"


def _failure(stage: str, what: str, exc: BaseException, path: str = "") -> Failure:
    memory = out_of_memory(exc)
    if memory:
        _reserve.clear()
        gc.collect()
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    text = clip(text, _MAX_MESSAGE_CHARS)
    where = _location(exc, path) if path else ""
    message = f"{what} raised {text}" + (f" ({where})" if where else "")
    if memory:
        message += memory_note()
    tb = clip("".join(traceback.format_exception(exc)), _MAX_TRACEBACK_CHARS)
    return Failure(stage=stage, message=message, traceback=tb)


def clip(text: str, limit: int) -> str:
    """``text`` cut to about ``limit`` characters, keeping its head and tail.

    Example: ``ValueError: xxxx ... [10485000 characters cut] ... xxTAIL``.
    """
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]} ... [{len(text) - 2 * half} characters cut] ... {text[-half:]}"


def seed_all(seed: int) -> None:
    """Seed Python's, torch's and numpy's generators (numpy's modulo 2**32)."""
    random.seed(seed)
    torch.manual_seed(seed)
    with contextlib.suppress(ImportError):
        import numpy

        numpy.random.seed(seed % (1 << 32))


def _outputs(result: Any, who: str) -> list[torch.Tensor]:
    """Normalise a forward result to a list of tensors.

    Raises:
        JobFailure: (stage ``mismatch``) the result holds something that is not a
            tensor or a number; (stage ``audit``) a tensor subclass, whose hooks
            (``__torch_function__``) would run candidate code when the harness reads it,
            after the op record stopped.
    """
    items = list(result) if isinstance(result, (tuple, list)) else [result]
    out = []
    for i, item in enumerate(items):
        if isinstance(item, torch.Tensor) and type(item) not in (torch.Tensor,
                                                                 torch.nn.Parameter):
            raise JobFailure(Failure(
                stage="audit",
                message=f"{who} returned a {type(item).__name__} (a torch.Tensor subclass) "
                        f"as output {i}; return plain tensors that the kernels wrote"))
        if isinstance(item, torch.Tensor):
            out.append(item)
        elif isinstance(item, (bool, int, float, complex)):
            out.append(torch.as_tensor(item))
        else:
            raise JobFailure(Failure(
                stage="mismatch",
                message=f"{who} returned a {type(item).__name__} as output {i}; "
                        "expected a tensor or a tuple of tensors"))
    return out


def _accelerator(backend: str) -> Any:
    """The torch device module (``torch.cuda``, ``torch.npu``) or None on cpu."""
    if backend == "cuda":
        return torch.cuda
    if backend == "ascend":
        return getattr(torch, "npu", None)
    return None


def _device(backend: str) -> torch.device:
    # One visible device (CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES), so index 0.
    return torch.device({"cuda": "cuda:0", "ascend": "npu:0"}.get(backend, "cpu"))


def _synchronize(backend: str) -> None:
    accel = _accelerator(backend)
    if accel is not None:
        accel.synchronize()


class _HostEvent:
    """A stand-in for ``torch.cuda.Event`` on the host clock (``time.perf_counter``), so
    the timing loop runs on ``cpu`` too (tests; no verdict times on cpu)."""

    def __init__(self, enable_timing: bool = True) -> None:
        self.at = 0.0

    def record(self) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        """Nothing to wait for: :meth:`record` read the host clock at once."""

    def elapsed_time(self, end: _HostEvent) -> float:
        return (end.at - self.at) * 1000.0  # milliseconds, like torch.cuda.Event


class _Host:
    Event = _HostEvent

    @staticmethod
    def synchronize() -> None:
        """Nothing to wait for: the host runs the calls synchronously."""


def _time_forward(model: Any, args: list[Any], spec: ChildSpec,
                  profile: Any = None, harness: Any = contextlib.nullcontext) -> Timing:
    """Median device-event time of ``model(*args)``, microseconds.

    ``spec.warmup`` untimed calls first; before each of ``spec.repeats`` timed calls a
    ``spec.flush_bytes`` buffer is overwritten so the call starts with a cold L2
    (H100/H200 L2 is 50-60 MiB; 256 MiB is well above it). On ``cpu`` the host clock
    stands in for device events.

    ``profile``: None, or a function turning ``torch.profiler``'s events into launch
    records (:func:`services.worker.profiling.profiled_launches`, given the events and
    ``"cuda"`` or ``"cpu"``); then the timed calls themselves (not the warm-up) run under
    ``torch.profiler`` (CPU and, on a GPU, CUDA activities), each flush inside
    ``record_function("aikg::l2_flush")`` and each call inside
    ``record_function("aikg::timed_call")``, and the Timing carries the launches. A
    profiler that does not start or stop leaves ``launches`` empty and says why in
    ``profiler_error`` (the samples stand).
    """
    accel = _accelerator(spec.backend) or _Host
    flush = torch.empty(spec.flush_bytes, dtype=torch.uint8, device=_device(spec.backend))
    start_wall = time.perf_counter()
    prof = None
    profiler_error = ""
    ranges = (contextlib.nullcontext, contextlib.nullcontext)
    with torch.no_grad():
        for _ in range(spec.warmup):
            model(*args)
        accel.synchronize()
        samples = []
        if profile is not None:
            from torch.profiler import ProfilerActivity, record_function
            from torch.profiler import profile as torch_profile

            activities = [ProfilerActivity.CPU]
            if spec.backend == "cuda":
                activities.append(ProfilerActivity.CUDA)
            try:
                with harness():
                    prof = torch_profile(activities=activities)
                    prof.__enter__()
                ranges = (lambda: record_function("aikg::l2_flush"),
                          lambda: record_function("aikg::timed_call"))
            except Exception as exc:  # noqa: BLE001 - the timing stands without it
                prof, profiler_error = None, f"{type(exc).__name__}: {str(exc)[:300]}"
        try:
            for _ in range(spec.repeats):
                with ranges[0]():
                    flush.fill_(0)
                begin = accel.Event(enable_timing=True)
                end = accel.Event(enable_timing=True)
                with ranges[1]():
                    begin.record()
                    model(*args)
                    end.record()
                end.synchronize()
                samples.append(begin.elapsed_time(end) * 1000.0)
        finally:
            launches = []
            if prof is not None:
                try:
                    accel.synchronize()
                    with harness():
                        prof.__exit__(None, None, None)
                        launches = profile(prof.events(), "cuda" if spec.backend == "cuda"
                                           else "cpu")
                except Exception as exc:  # noqa: BLE001 - the timing stands without it
                    profiler_error = f"{type(exc).__name__}: {str(exc)[:300]}"
    return Timing(median_us=statistics.median(samples), samples_us=samples,
                  wall_s=time.perf_counter() - start_wall, launches=launches,
                  profiled=prof is not None and not profiler_error,
                  profiler_error=profiler_error)


def _time_compiled(model: Any, args: list[Any], spec: ChildSpec,
                   on_compiled: Any = None) -> Timing:
    """:func:`_time_forward` of ``torch.compile(model)`` (default mode, Inductor), after
    one call that compiles it; labelled ``compile``. A compile that raises gives a
    Timing with ``error`` and no samples (the caller's verdict never depends on it).

    ``on_compiled``: called once the compile is done, before the timing loop (the
    reference child announces its ``profiling`` phase there, so the parent's wall-time
    check covers the timed calls, not the compile).
    """
    started = time.perf_counter()
    try:
        import torch._inductor.config as inductor_config

        # One process: the sandbox is no place for a pool of compile workers.
        inductor_config.compile_threads = 1
        compiled = torch.compile(model)
        with torch.no_grad():
            compiled(*args)
        _synchronize(spec.backend)
    except Exception as exc:  # noqa: BLE001 - torch.compile on the task's code
        message = clip(f"{type(exc).__name__}: {exc}".strip(), 600)
        return Timing(median_us=0.0, samples_us=[], wall_s=time.perf_counter() - started,
                      label="compile", error=message)
    if on_compiled is not None:
        on_compiled()
    try:
        timing = _time_forward(compiled, args, spec)
    except Exception as exc:  # noqa: BLE001 - the compiled code failed where eager ran
        message = clip(f"{type(exc).__name__}: {exc}".strip(), 600)
        return Timing(median_us=0.0, samples_us=[], wall_s=time.perf_counter() - started,
                      label="compile", error=f"the compiled Model failed: {message}")
    timing.label = "compile"
    return timing


def _time_floor(spec: ChildSpec, profile: Any = None) -> Timing:
    """:func:`_time_forward` of a one-element ``fill_`` (one kernel launch doing no work),
    labelled ``floor``: what the timing method gives the cheapest launch. Its
    ``launches`` are what the harness's own timing loop launches around a call that
    does nothing (the flushes, that fill)."""
    tiny = torch.empty(1, dtype=torch.float32, device=_device(spec.backend))
    timing = _time_forward(lambda: tiny.fill_(0), [], spec, profile=profile)
    timing.label = "floor"
    return timing


def _unwrap(exc: BaseException) -> BaseException:
    """The kernel's own exception inside the interpreter's InterpreterError wrapper."""
    from triton.runtime.errors import InterpreterError

    while isinstance(exc, InterpreterError) and exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


def _kernel_frame(exc: BaseException, kernels: set[str], path: str) -> str | None:
    """Name of the innermost kernel whose frame (in ``path``) is in ``exc``'s traceback.

    Matched by name: the interpreter runs a rewritten copy of the kernel's code.
    """
    found = None
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename == path and code.co_name in kernels:
            found = code.co_name
        tb = tb.tb_next
    return found


def _candidate_failure(what: str, exc: BaseException, kernels: set[str], path: str) -> Failure:
    """Classify an exception from candidate code as ``compile`` or ``runtime``.

    On a GPU Triton raises ``CompilationError`` for a kernel that does not type-check
    (unknown ``tl`` function, bad shapes). The interpreter runs the kernel body as
    Python, so the same mistakes surface as AttributeError, NameError, TypeError or
    ValueError raised inside a kernel's frame (wrapped in InterpreterError); those
    count as compile errors too, reported at the kernel's line. Errors the interpreter
    raises while executing an operation on data (its innermost frame is in
    triton/runtime/interpreter.py, e.g. ``mask has unsupported dtype`` from a masked
    load) are runtime errors: the program got past the front end.
    """
    from triton.compiler.errors import CompilationError

    inner = _unwrap(exc)
    kernel = _kernel_frame(inner, kernels, path)
    if isinstance(inner, CompilationError) or (
            kernel is not None and not _raised_by_interpreter(inner) and isinstance(
                inner, (AttributeError, NameError, TypeError, ValueError, AssertionError))):
        name = f" {kernel}" if kernel is not None else ""
        failure = _failure("compile", f"compiling the Triton kernel{name}", inner, path)
    else:
        what = f"{what} (Triton kernel {kernel})" if kernel is not None else what
        failure = _failure("runtime", what, inner, path)
    failure.traceback = clip("".join(traceback.format_exception(exc)), _MAX_TRACEBACK_CHARS)
    return failure


def _raised_by_interpreter(exc: BaseException) -> bool:
    """True when ``exc``'s innermost frame is the interpreter's op emulation (or the
    replayer's bounds check in front of its memory accesses)."""
    tb = exc.__traceback__
    last = None
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename.replace(os.sep, "/")
        if not name.endswith("services/worker/replay.py"):
            last = name
        tb = tb.tb_next
    return last is not None and last.endswith("triton/runtime/interpreter.py")


def _kernel_names(module: Any) -> set[str]:
    """Function names of the module's Triton kernels (jit, interpreted, autotuned)."""
    names = set()
    for value in vars(module).values():
        fn = value
        for _ in range(4):
            inner = getattr(fn, "fn", None)
            if inner is None:
                break
            fn = inner
        name = getattr(fn, "__name__", None)
        if name is not None and fn is not value and callable(fn):
            names.add(name)
    return names


# ---------------------------------------------------------------- jobs


_PROBE_KERNEL = """\
import triton
import triton.language as tl


@triton.jit
def probe_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * 2.0 + 1.0, mask=mask)
"""


def _probe_kernel(spec: ChildSpec) -> None:
    """Compile and launch a tiny Triton kernel the way candidates will.

    After the user switch this needs what every candidate needs: the device nodes,
    a writable Triton cache, Triton's bundled compiler tools (ptxas on cuda) and the
    driver. Failing here lets the worker fall back to its own user, or refuse to
    start, instead of failing every candidate at ``compile``.

    Raises:
        JobFailure: stage ``infrastructure``, naming what failed.
    """
    path = os.path.join(os.getcwd(), "probe_kernel.py")
    with open(path, "w") as f:
        f.write(_PROBE_KERNEL)
    try:
        module = _load_module("aikg_probe_kernel", path)
        device = _device(spec.backend)
        x = torch.arange(100, dtype=torch.float32, device=device)
        out = torch.empty_like(x)
        module.probe_kernel[(1,)](x, out, x.numel(), BLOCK=128)
        _synchronize(spec.backend)
        wrong = not torch.equal(out.cpu(), x.cpu() * 2.0 + 1.0)
    except Exception as exc:
        raise JobFailure(_failure("infrastructure", "a probe Triton kernel", exc)) from None
    if wrong:
        raise JobFailure(Failure(stage="infrastructure",
                                 message="a probe Triton kernel returned wrong values"))


def run_probe(spec: ChildSpec, channel: Channel) -> None:
    """Role ``probe``: what every child needs works here (see :meth:`Sandbox.start`)."""
    # After the user switch the Python installation must still be readable (lazy
    # imports) and the scratch directory writable.
    with open(os.__file__, "rb") as f:
        f.read(1)
    with open("probe.txt", "w") as f:
        f.write("ok")
    if spec.backend == "cuda" and not torch.cuda.is_available():
        raise JobFailure(Failure(stage="infrastructure",
                                 message="no CUDA device is usable inside the sandbox"))
    _probe_kernel(spec)


def _run(spec: ChildSpec, channel: Channel) -> None:
    if spec.backend == "cpu":
        import triton

        triton.knobs.runtime.interpret = True
        # A cpu "device" is a slot: one core's worth. Two OpenMP threads per child on
        # a busy machine spin at barriers (measured: 5-10x slower elementwise ops at
        # load 3 on 2 cores), and the interpreter's work is single-threaded numpy.
        torch.set_num_threads(1)
    elif spec.backend == "ascend":
        # Registers torch.npu; imported here, after ASCEND_RT_VISIBLE_DEVICES is set,
        # never in the fork server (it would initialise the device runtime before fork).
        try:
            import torch_npu  # noqa: F401
        except ImportError as exc:
            raise JobFailure(_failure("infrastructure", "importing torch_npu", exc)) from None
    module, _, name = (spec.runner or runner_of(spec.role)).partition(":")
    getattr(importlib.import_module(module), name)(spec, channel)


def main(spec: ChildSpec, result_fd: int) -> NoReturn:
    """Run one job in this freshly forked process and exit; never returns.

    Every outcome is a frame on ``result_fd``: a Failure (with the stage) or Done.
    A process that dies without either (signal, ``os._exit``) is a crash; the
    parent learns how from the fork server's wait status.
    """
    # Before any job code: the tensor methods the channel reads outputs with.
    capture_tensor_methods()
    channel = Channel(result_fd, spec.frame_key)
    _limit_notes.update(spec.limit_notes)
    try:
        hello = enter_sandbox(spec)
    except BaseException as exc:
        channel.send(_failure("infrastructure", "entering the sandbox", exc))
        os._exit(0)
    _reserve.append(bytearray(_EMERGENCY_BYTES))
    try:
        channel.send(hello)
        _run(spec, channel)
        frame: Any = Done()
    except JobFailure as exc:
        frame = exc.failure
    except BaseException as exc:  # noqa: BLE001 - SystemExit from candidate code too
        frame = _failure("runtime", "the job", exc, spec.candidate_path)
    with contextlib.suppress(BaseException):
        sys.stdout.flush()
        sys.stderr.flush()
    with contextlib.suppress(BaseException):
        channel.send(frame)
    os._exit(0)
