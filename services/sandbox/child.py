"""Code that runs inside a sandboxed child: the entry, the helpers role runners share,
and the ``probe`` role.

A child is forked by :mod:`services.sandbox.forkserver` (which has torch and triton
imported already), enters the sandbox (:func:`enter_sandbox`), sets up its backend,
then calls the runner its spec names (``spec.runner``, ``module:function``, from
:mod:`services.sandbox.roles`). The only role here is ``probe``: nothing but the
sandbox entry and a tiny Triton launch; :meth:`Sandbox.start
<services.sandbox.pool.Sandbox.start>` uses it to learn which isolation steps this
machine permits. Every other role is its owner's (the worker's verification, the
generator's lowering), registered there.

The helpers here are what any runner needs: a :class:`JobFailure` that ends the job
with a :class:`~services.sandbox.wire.Failure`, a failure built from an exception
(:func:`failure_of`, naming an address-space limit that was hit), the backend's device
and its synchronisation, a module loaded from a file.

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
import sys
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
    capture_tensor_methods,
)

# A scratch allocation released when a MemoryError is handled, so that the error
# report itself can still be built and sent.
_EMERGENCY_BYTES = 4 << 20
# Exception messages can be megabytes (tensor reprs); the coder needs the start and
# the end (the last line often names the cause). Tracebacks are cut the same way.
_MAX_MESSAGE_CHARS = 2000
MAX_TRACEBACK_CHARS = 32000


# ---------------------------------------------------------------- job helpers


class JobFailure(Exception):
    """Stop the job and report ``failure``."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.message)
        self.failure = failure


def load_module(name: str, path: str) -> Any:
    """Import the file at ``path`` as module ``name`` (Triton reads kernel source from it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def location(exc: BaseException, path: str) -> str:
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


def failure_of(stage: str, what: str, exc: BaseException, path: str = "") -> Failure:
    """A Failure at ``stage`` saying ``what`` raised ``exc``: its type and message
    (clipped to 2,000 characters), its line in the file at ``path`` (if any), the
    address-space limit when it ran out of memory (:func:`memory_note`; the emergency
    reserve is freed first), and its traceback (clipped to :data:`MAX_TRACEBACK_CHARS`)."""
    memory = out_of_memory(exc)
    if memory:
        _reserve.clear()
        gc.collect()
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    text = clip(text, _MAX_MESSAGE_CHARS)
    where = location(exc, path) if path else ""
    message = f"{what} raised {text}" + (f" ({where})" if where else "")
    if memory:
        message += memory_note()
    tb = clip("".join(traceback.format_exception(exc)), MAX_TRACEBACK_CHARS)
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


def accelerator(backend: str) -> Any:
    """The torch device module (``torch.cuda``, ``torch.npu``) or None on cpu."""
    if backend == "cuda":
        return torch.cuda
    if backend == "ascend":
        return getattr(torch, "npu", None)
    return None


def device_of(backend: str) -> torch.device:
    """The torch device of ``backend``'s one visible device (``cuda:0``, ``npu:0``, ``cpu``)."""
    # One visible device (CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES), so index 0.
    return torch.device({"cuda": "cuda:0", "ascend": "npu:0"}.get(backend, "cpu"))


def synchronize(backend: str) -> None:
    """Wait for ``backend``'s device to finish its queued work (nothing to wait for on cpu)."""
    accel = accelerator(backend)
    if accel is not None:
        accel.synchronize()


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
        module = load_module("aikg_probe_kernel", path)
        device = device_of(spec.backend)
        x = torch.arange(100, dtype=torch.float32, device=device)
        out = torch.empty_like(x)
        module.probe_kernel[(1,)](x, out, x.numel(), BLOCK=128)
        synchronize(spec.backend)
        wrong = not torch.equal(out.cpu(), x.cpu() * 2.0 + 1.0)
    except Exception as exc:
        raise JobFailure(failure_of("infrastructure", "a probe Triton kernel", exc)) from None
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
            raise JobFailure(failure_of("infrastructure", "importing torch_npu", exc)) from None
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
    channel = Channel(result_fd, spec.frame_key, spec.role)
    _limit_notes.update(spec.limit_notes)
    try:
        hello = enter_sandbox(spec)
    except BaseException as exc:
        channel.send(failure_of("infrastructure", "entering the sandbox", exc))
        os._exit(0)
    _reserve.append(bytearray(_EMERGENCY_BYTES))
    try:
        channel.send(hello)
        _run(spec, channel)
        frame: Any = Done()
    except JobFailure as exc:
        frame = exc.failure
    except BaseException as exc:  # noqa: BLE001 - SystemExit from candidate code too
        frame = failure_of("runtime", "the job", exc, spec.candidate_path)
    with contextlib.suppress(BaseException):
        sys.stdout.flush()
        sys.stderr.flush()
    with contextlib.suppress(BaseException):
        channel.send(frame)
    os._exit(0)
