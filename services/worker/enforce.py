"""What the candidate's process may no longer do once it holds inputs, enforced below
Python where Linux and PyTorch allow it.

The verdict does not rest on these (the candidate sees only decoys and the replayer
decides, :mod:`services.worker.trace`); they turn a cheat into a clear refusal at
stage ``audit`` instead of a silent mismatch, and keep the candidate's process from
doing work the plan does not show.

* :func:`block_compute`: every ATen operator outside
  :data:`services.worker.rules.ALLOWED_OPS` gets a kernel at the backend's dispatch
  keys (``CPU`` and its sparse, quantized, MKLDNN and nested variants; ``CUDA`` on a
  GPU) that raises. It sits in the dispatcher's table, not in a Python mode, so it
  holds on every thread, under ``torch._C._DisableTorchDispatch``, in inference mode
  and after the candidate removed any Python recorder. Registered after the
  candidate's constructors ran (they may compute on weights; no input exists yet).
* :func:`refuse_threads_and_processes`: ``_thread.start_new_thread``, ``os.fork``,
  ``os.posix_spawn``, ``os.system``, ``os.exec*`` raise (and are counted); on ``cpu``
  a stacked seccomp filter refuses ``clone``, ``fork``, ``vfork``, ``execve`` and
  ``execveat`` with EPERM, whatever module or native library asks.
* :func:`namespace_snapshot` / :func:`namespace_changes`: attributes of torch's and
  triton's modules and classes that the candidate's import replaced.
"""

from __future__ import annotations

import errno
import sys
import warnings
from typing import Any

import torch

from services.worker.rules import ALLOWED_OPS
from services.worker.trace import REFUSED_PREFIX

# Operators the candidate's process still needs besides the allowlist: Triton's
# launcher re-seats host copies (set_), out= kernels of allowed ops resize their
# outputs (resize_), parameter assignment checks types.
_ALSO_ALLOWED = frozenset({"set_", "resize_", "_has_compatible_shallow_copy_type",
                           "is_same_size", "record_stream", "_version", "lift",
                           "_propagate_xla_data", "sym_size", "sym_stride", "sym_numel",
                           "sym_storage_offset", "detach_", "requires_grad_", "_conj",
                           "_neg_view", "conj", "_reshape_copy"})
_CPU_KEYS = ("CPU", "SparseCPU", "QuantizedCPU", "MkldnnCPU", "SparseCsrCPU",
             "NestedTensorCPU")
_GPU_KEYS = ("CUDA", "SparseCUDA", "QuantizedCUDA", "SparseCsrCUDA", "NestedTensorCUDA")
_ANY_KEYS = ("CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional")
# (overload name, dispatch keys to block it at), computed once per process (the fork
# server's warm-up), ~0.15 s.
_BLOCK_LIST: list[tuple[str, tuple[str, ...]]] | None = None
# Keeps the registrations alive (a Library unregisters when collected).
_LIBRARIES: list[Any] = []


def block_list() -> list[tuple[str, tuple[str, ...]]]:
    """Every ATen overload outside the allowlist that has a kernel of its own (a
    CPU-side one, or a CompositeExplicitAutograd one, blocked at ``CPU``), with those
    keys (computed once)."""
    global _BLOCK_LIST
    if _BLOCK_LIST is None:
        has = torch._C._dispatch_has_kernel_for_dispatch_key
        found = []
        for name in torch._C._dispatch_get_all_op_names():
            if not name.startswith("aten::"):
                continue
            full = name[len("aten::"):]
            packet = full.split(".")[0]
            if packet in ALLOWED_OPS or packet in _ALSO_ALLOWED:
                continue
            keys = tuple(k for k in _CPU_KEYS if has(name, k))
            if not keys and any(has(name, k) for k in _ANY_KEYS):
                keys = ("CPU",)
            # CompositeImplicitAutograd-only operators compute nothing themselves:
            # they decompose into operators checked here.
            if keys:
                found.append((full, keys))
        _BLOCK_LIST = found
    return _BLOCK_LIST


def warm_up() -> None:
    """Fork-server warm-up: compute :func:`block_list` once for every child."""
    block_list()


def _refuse(name: str) -> Any:
    def blocked(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{REFUSED_PREFIX}aten.{name} is not available in ModelNew.forward: PyTorch "
            "compute operators are refused in the candidate's process once it holds "
            "inputs; do the work in Triton kernels (allocation, views and layout copies "
            "are allowed)")

    blocked.__name__ = f"refused_{name.replace('.', '_')}"
    return blocked


def block_compute(backend: str) -> int:
    """Register a refusing kernel for every operator of :func:`block_list` at this
    backend's dispatch keys.

    Returns:
        How many (operator, key) registrations were made.
    """
    lib = torch.library.Library("aten", "IMPL")
    _LIBRARIES.append(lib)
    gpu = backend in ("cuda", "ascend")
    # The library's C++ registrar where this torch has it: Library.impl's Python-side
    # checks and bookkeeping (for a library that is never destroyed) cost ~40% of the
    # ~2,500 registrations (measured 59 ms against 37 ms on torch 2.9, one core).
    registrar = getattr(lib, "m", None)

    def register(name: str, fn: Any, key: str) -> None:
        if registrar is not None:
            registrar.impl(name, key, fn, False)
        else:
            lib.impl(name, fn, key)

    count = 0
    with warnings.catch_warnings():
        # "Overriding a previously registered kernel": that is the point.
        warnings.simplefilter("ignore")
        for full, keys in block_list():
            targets = list(keys)
            if gpu:
                targets.append("CUDA" if backend == "cuda" else "PrivateUse1")
            refuse = _refuse(full)
            for key in targets:
                try:
                    register(full, refuse, key)
                    count += 1
                except RuntimeError:
                    continue
    return count


# ---------------------------------------------------------------- threads, processes


def refuse_threads_and_processes(backend: str, refused: list[str]) -> list[str]:
    """Refuse new threads and processes from now on (see the module doc); each refused
    attempt appends a line to ``refused``.

    Returns:
        Notes on what could not be enforced (an empty list when everything holds).
    """
    import _thread
    import os
    import threading

    # Before the patches below: finding libseccomp runs ldconfig in a subprocess.
    try:
        import pyseccomp as seccomp
    except (ImportError, OSError, RuntimeError) as exc:  # RuntimeError: no libseccomp
        seccomp, missing = None, exc

    def refusing(what: str) -> Any:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            refused.append(f"{what} (the candidate's process may not start threads or "
                           "processes)")
            raise PermissionError(errno.EPERM, f"the sandbox refused {what}: the candidate's "
                                  "process may not start threads or processes")

        return refuse

    _thread.start_new_thread = refusing("starting a thread")
    _thread.start_new = _thread.start_new_thread
    threading._start_new_thread = _thread.start_new_thread
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "execv",
                 "execve", "execl", "execle", "execlp", "execlpe", "execvp", "execvpe",
                 "spawnv", "spawnve", "spawnl", "spawnle", "popen"):
        if hasattr(os, name):
            setattr(os, name, refusing(f"os.{name}"))
    subprocess = sys.modules.get("subprocess")
    if subprocess is not None:
        subprocess.Popen.__init__ = refusing("subprocess.Popen")
    if backend != "cpu":
        # The CUDA runtime and Triton's compiler (ptxas) start threads and processes
        # of their own; below Python only the user, Landlock and the PID namespace
        # confine them there.
        return ["threads and processes are refused in Python only on GPU backends (the "
                "CUDA runtime and ptxas need them)"]
    if seccomp is None:
        return [f"threads and processes refused in Python only: libseccomp missing "
                f"({missing})"]
    try:
        flt = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
        for name in ("clone", "fork", "vfork", "execve", "execveat"):
            try:
                flt.add_rule(seccomp.ERRNO(errno.EPERM), name)
            except Exception:  # noqa: BLE001 - not on this architecture
                continue
        try:
            flt.add_rule(seccomp.ERRNO(errno.EPERM), "clone3")
        except Exception:  # noqa: BLE001
            pass
        flt.load()
    except Exception as exc:  # noqa: BLE001 - pyseccomp raises several types
        return [f"threads and processes refused in Python only: seccomp: {exc}"]
    return []


# ---------------------------------------------------------------- namespaces


def _watched() -> dict[str, Any]:
    import triton
    import triton.language as tl
    from triton.runtime import autotuner, interpreter, jit

    watched: dict[str, Any] = {
        "torch": torch, "torch.nn": torch.nn, "torch.nn.functional": torch.nn.functional,
        "torch.Tensor": torch.Tensor, "torch.cuda": torch.cuda, "torch.testing": torch.testing,
        "triton": triton, "triton.language": tl, "triton.runtime.jit.JITFunction": jit.JITFunction,
        "triton.runtime.interpreter.InterpretedFunction": interpreter.InterpretedFunction,
        "triton.runtime.autotuner.Autotuner": autotuner.Autotuner,
    }
    return watched


def namespace_snapshot() -> dict[str, dict[str, int]]:
    """``{"torch": {attribute: id(value)}, ...}`` of the watched namespaces."""
    return {name: {k: id(v) for k, v in list(vars(obj).items())}
            for name, obj in _watched().items()}


def namespace_changes(snapshot: dict[str, dict[str, int]]) -> list[str]:
    """Attributes of the watched namespaces replaced or removed since ``snapshot``
    (modules added by a lazy import are not changes), e.g. ``torch.randn replaced``."""
    changes = []
    import types

    for name, obj in _watched().items():
        before = snapshot.get(name, {})
        now = dict(vars(obj))
        for attr, ident in before.items():
            if attr not in now:
                changes.append(f"{name}.{attr} removed")
            elif id(now[attr]) != ident and not attr.startswith("__") \
                    and not isinstance(now[attr], types.ModuleType):
                changes.append(f"{name}.{attr} replaced")
        for attr in now.keys() - before.keys():
            if not isinstance(now[attr], types.ModuleType) and not attr.startswith("_"):
                changes.append(f"{name}.{attr} added")
    return sorted(changes)
