"""What the worker's children share beyond the sandbox's helpers: a forward call's
result as tensors (the reference's ``Model``, the candidate's ``ModelNew``), an
exception from candidate code classified as ``compile`` or ``runtime``, and the names
of a module's Triton kernels.

Runs inside a sandboxed child (:mod:`services.worker._reference`,
:mod:`services.worker._planner`, :mod:`services.worker._replayer`).
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import torch

from services.sandbox.child import MAX_TRACEBACK_CHARS, JobFailure, clip, failure_of
from services.sandbox.wire import Failure


def forward_outputs(result: Any, who: str) -> list[torch.Tensor]:
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


def candidate_failure(what: str, exc: BaseException, kernels: set[str], path: str) -> Failure:
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
        failure = failure_of("compile", f"compiling the Triton kernel{name}", inner, path)
    else:
        what = f"{what} (Triton kernel {kernel})" if kernel is not None else what
        failure = failure_of("runtime", what, inner, path)
    failure.traceback = clip("".join(traceback.format_exception(exc)), MAX_TRACEBACK_CHARS)
    return failure


def _raised_by_interpreter(exc: BaseException) -> bool:
    """True when ``exc``'s innermost frame is the interpreter's op emulation (or the
    replayer's bounds check in front of its memory accesses)."""
    tb = exc.__traceback__
    last = None
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename.replace(os.sep, "/")
        if not name.endswith(("services/worker/replay.py",
                              "services/worker/replay_memory.py")):
            last = name
        tb = tb.tb_next
    return last is not None and last.endswith("triton/runtime/interpreter.py")


def kernel_names(module: Any) -> set[str]:
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
