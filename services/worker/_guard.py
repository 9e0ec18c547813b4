"""In-child instruments around candidate code: op recorder, audit hook, ghost replay.

Runs inside the sandboxed candidate child, so none of it decides a verdict on its own
(the candidate could tamper with anything in its process): it reports what it saw and
the parent (:mod:`services.worker.verifier`) applies the rules of
:mod:`services.worker.rules`. Kept apart from :mod:`services.worker._child` so that
objects the candidate can find (the dispatch mode on torch's mode stack) lead to
nothing of the harness: this module holds no reference to the result channel.

* :class:`OpRecorder`: a ``TorchDispatchMode`` (torch/utils/_python_dispatch.py)
  counting the ATen operators run while it is active; ops issued from Triton's own
  frames (its launcher copies arguments) are counted apart. In ghost mode it also
  fills new floating-point allocations with NaN, so untouched outputs cannot equal
  the reference by chance.
* :func:`install_audit_hook`: a PEP 578 hook (``sys.addaudithook``; it cannot be
  removed from Python) that refuses, when the nearest non-stdlib frame is the
  candidate's, the events that reach harness objects or the result channel: gc's
  object walks, frame access, ctypes, ``/proc``, new sockets, tracing, exec/compile.
* :func:`guard_host_reads`: candidate calls that hand tensor data to host Python or
  numpy (``Tensor.numpy``, ``tolist``, ``__array__``, ``__dlpack__``, storages) are
  counted while the recorder is active, with ``.item()``/``float()`` reads (ATen
  ``_local_scalar_dense``), as elements read per ``forward`` call: numpy computes
  where no ATen op is seen, and a read lets forward tell the ghost replay's NaN-filled
  allocations apart.
* :func:`ghost_launches`: every Triton kernel launch becomes a no-op.
* :func:`first_autotune_config`: on the interpreter, a multi-config ``@triton.autotune``
  runs its first config without benchmarking (the interpreter has no benchmarker).
"""

from __future__ import annotations

import collections
import os
import sys
import sysconfig
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from services.worker import _frames

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_STDLIB_DIRS = tuple({sysconfig.get_paths()["stdlib"] + os.sep,
                      sysconfig.get_paths()["platstdlib"] + os.sep})
_THIS_FILE = __file__


def _triton_dir() -> str:
    import triton

    return os.path.dirname(triton.__file__) + os.sep


_TRITON_DIR = _triton_dir()
_LIBRARY_DIRS = (_TORCH_DIR, _TRITON_DIR, os.path.dirname(os.path.dirname(__file__)) + os.sep)
_ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "new_empty",
                          "new_empty_strided", "empty_permuted"})


def _in_stdlib(filename: str) -> bool:
    # A venv's platstdlib is a prefix of its site-packages: those are libraries.
    return filename.startswith(_STDLIB_DIRS) and "-packages" + os.sep not in filename


def _is_stdlib(filename: str) -> bool:
    return _in_stdlib(filename) or filename.startswith("<frozen")


def _passed_over(filename: str) -> bool:
    """Frames an instrument looks past for its caller: torch, the standard library,
    this module and :mod:`services.worker._frames`."""
    return (filename.startswith(_TORCH_DIR) or _is_stdlib(filename)
            or filename in (_THIS_FILE, _frames.__file__))


# The recorder around the forward call running now (None between calls).
_ACTIVE: list[OpRecorder | None] = [None]


class OpRecorder(TorchDispatchMode):
    """Counts ATen ops by overload name (``aten.relu.default``) while active.

    ``ops``: issued by anything but Triton; ``launcher_ops``: issued with a Triton
    frame as the nearest frame outside torch. ``ghost``: NaN-fill (floating) or
    max-fill (integer) what ``empty``-family ops return. ``host_reads``: calls that
    handed tensor data to host code (``Tensor.numpy`` ...; see
    :func:`guard_host_reads`); ``host_elements``: the most tensor elements one
    ``forward`` call read that way or by ``.item()``.
    """

    def __init__(self, ghost: bool = False) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.launcher_ops: collections.Counter[str] = collections.Counter()
        self.host_reads: collections.Counter[str] = collections.Counter()
        self.host_elements = 0
        self._call_elements = 0
        self.ghost = ghost

    def __enter__(self):  # noqa: ANN204
        self._call_elements = 0
        _ACTIVE[0] = self
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        _ACTIVE[0] = None
        self.host_elements = max(self.host_elements, self._call_elements)
        super().__exit__(*exc)

    def host_read(self, what: str, elements: int) -> None:
        """Count ``elements`` tensor elements handed to host code by ``what``."""
        self.host_reads[what] += 1
        self._call_elements += elements

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = str(func)
        from_triton = _frames.caller_file(1, _passed_over).startswith(_TRITON_DIR)
        (self.launcher_ops if from_triton else self.ops)[name] += 1
        if not from_triton and name == "aten._local_scalar_dense.default":
            self._call_elements += 1
        out = func(*args, **(kwargs or {}))
        if self.ghost and not from_triton and isinstance(out, torch.Tensor) and (
                name.split(".")[1] in _ALLOCATIONS):
            with torch.no_grad():
                if out.dtype.is_floating_point or out.dtype.is_complex:
                    out.fill_(float("nan"))
                elif out.dtype != torch.bool:
                    out.fill_(torch.iinfo(out.dtype).max)
        return out


_REFUSED_EVENTS = frozenset({
    "gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._getframe",
    "sys._current_frames", "sys._current_exceptions", "sys.settrace", "sys.setprofile",
    "object.__getattr__", "object.__setattr__", "object.__delattr__", "code.__new__",
    "function.__new__", "exec", "compile", "socket.__new__", "socket.fromfd",
})


def install_audit_hook(candidate_path: str) -> list[str]:
    """Install the audit hook; returns the list it appends refused events to.

    "Candidate-originated": walking outward from the event, the first frame that is
    not the standard library's (nor this module's) is in the candidate's scratch
    directory or has no file (``<string>``: code the candidate compiled). Libraries
    (torch, triton, the harness, the import system) keep their rights, so Triton may
    still compile kernels, torch may read frames and ``import`` works.

    Raises (from the hook, into candidate code):
        PermissionError: ``the sandbox refused gc.get_objects: ...``.
    """
    refused: list[str] = []
    busy = [False]
    scratch = os.path.dirname(candidate_path) + os.sep

    def candidate_originated() -> bool:
        frame = sys._getframe(2)
        while frame is not None:
            name = frame.f_code.co_filename
            if name == _THIS_FILE or _in_stdlib(name):
                frame = frame.f_back
                continue
            # The import system (frozen importlib) decides like a library: a candidate's
            # import statement may load modules.
            return name.startswith(scratch) or not (
                name.startswith("/") or name.startswith("<frozen"))
        return False

    def refuse(event: str, args: tuple[Any, ...]) -> bool:
        if event in _REFUSED_EVENTS or event.startswith("ctypes."):
            return True
        if event in ("open", "os.listdir", "os.scandir") and args:
            path = args[0]
            if isinstance(path, bytes):
                path = path.decode(errors="replace")
            return isinstance(path, str) and os.path.abspath(path).startswith("/proc/")
        return False

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if busy[0] or not refuse(event, args):
            return
        busy[0] = True
        try:
            if not candidate_originated():
                return
        finally:
            busy[0] = False
        what = event if event not in ("object.__getattr__", "object.__setattr__") else (
            f"{event} ({args[1]!r})" if len(args) > 1 else event)
        if event == "open":
            what = f"open({args[0]!r})"
        busy[0] = True
        try:
            frame = sys._getframe(1)
            while frame is not None and not frame.f_code.co_filename.startswith(scratch):
                frame = frame.f_back
            if frame is not None:
                what += f" (candidate.py line {frame.f_lineno})"
        finally:
            busy[0] = False
        refused.append(what)
        raise PermissionError(f"the sandbox refused {what}: candidate code may not inspect "
                              "the harness, its frames or its file descriptors")

    sys.addaudithook(hook)
    return refused


# Tensor methods that hand a tensor's data to host Python or numpy without an ATen op.
_HOST_READS = ("numpy", "tolist", "__array__", "__dlpack__", "untyped_storage", "storage",
               "_typed_storage")


def guard_host_reads() -> None:
    """Count host reads of tensor data by candidate code while a recorder is active.

    Wraps :data:`_HOST_READS` on ``torch.Tensor``; a call whose nearest frame outside
    torch and the standard library is neither Triton's (its launcher) nor the
    harness's adds the tensor's element count (its whole storage's for a storage) to
    the active recorder. ``torch._C.TensorBase``'s own methods cannot be wrapped (an
    immutable type); the static check refuses the names that reach them.
    """
    for name in _HOST_READS:
        original = getattr(torch.Tensor, name, None)
        if original is None:
            continue

        def wrapper(self, *args, __original=original, __name=name, **kwargs):  # noqa: ANN001
            recorder = _ACTIVE[0]
            if recorder is not None:
                caller = _frames.caller_file(1, _passed_over)
                if not caller.startswith((_TRITON_DIR, _LIBRARY_DIRS[2])):
                    elements = self.numel()
                    if __name in ("untyped_storage", "storage", "_typed_storage"):
                        # The whole storage (a view's base included); the C method
                        # directly, so this wrapper does not count itself.
                        elements = torch._C.TensorBase.untyped_storage(self).nbytes() // max(
                            self.element_size(), 1)
                    recorder.host_read(f"Tensor.{__name}", elements)
            return __original(self, *args, **kwargs)

        wrapper.__name__ = name
        setattr(torch.Tensor, name, wrapper)


def ghost_launches() -> None:
    """Make every Triton kernel launch a no-op in this process (interpreter and compiled)."""
    from triton.runtime import autotuner, interpreter, jit

    def no_launch(self, *args, **kwargs):  # noqa: ANN001, ARG001
        return None

    interpreter.InterpretedFunction.run = no_launch
    jit.JITFunction.run = no_launch
    autotuner.Autotuner.run = no_launch
    autotuner.Heuristics.run = no_launch


def first_autotune_config(notes: list[str]) -> None:
    """Multi-config ``@triton.autotune`` on the interpreter: run the first config.

    Triton's autotuner benchmarks every config with the active driver's benchmarker,
    which the interpreter does not have ("0 active drivers"). Keeping only the first
    config skips benchmarking the way Triton itself does for a single config
    (``Autotuner.run`` in triton/runtime/autotuner.py). Appends a note to ``notes``.
    """
    from triton.runtime import autotuner

    original = autotuner.Autotuner.prune_configs

    def prune_configs(self, kwargs):  # noqa: ANN001
        configs = original(self, kwargs)
        if len(configs) > 1:
            name = getattr(self.base_fn, "__name__", "kernel")
            note = (f"autotune: {name} ran its first config ({configs[0]}) without "
                    "benchmarking; the interpreter cannot time configs")
            if note not in notes:
                notes.append(note)
            return configs[:1]
        return configs

    autotuner.Autotuner.prune_configs = prune_configs


def hide_harness() -> None:
    """Remove the harness's modules from ``sys.modules`` (and the fork server's ``__main__``).

    Candidate code that looks them up gets fresh copies at most, never the objects
    this process's harness runs on. Called just before the candidate is imported.
    """
    import types

    for name in [n for n in sys.modules if n == "services" or n.startswith("services.")]:
        del sys.modules[name]
    main = sys.modules.get("__main__")
    if main is not None and getattr(main, "__file__", "").startswith(_LIBRARY_DIRS[2]):
        sys.modules["__main__"] = types.ModuleType("__main__")

