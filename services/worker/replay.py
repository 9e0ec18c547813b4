"""Run a candidate's recorded launch plan on the real inputs: the replayer child's work.

The planner (:mod:`services.worker.trace`) recorded, on decoys, every ATen operator and
Triton launch of ``forward``. :class:`Replayer` executes that plan in a process that
never runs the candidate's Python: only the operators of
:data:`services.worker.rules.ALLOWED_OPS` (allocation, views, layout and dtype copies),
through ``torch.ops.aten``, and the candidate's ``@triton.jit`` kernels, loaded from a
module that holds nothing else (:mod:`services.worker.kernel_source`). Its outputs are
what the worker compares with the reference.

* Undefined allocations (``empty`` ...) are NaN-filled, so an output no kernel wrote
  cannot match.
* Every tensor of an event must view a storage the plan made, an input, or a captured
  storage, within its bounds; every op's outputs must have the shapes, strides and
  dtypes the plan recorded. Otherwise the plan does not describe what ran
  (:class:`ReplayError` kind ``trace``).
* An operator outside the allowlist is kind ``compute`` (rule D002: PyTorch computed).
* On the interpreter every load, store and atomic is bounds-checked against the
  storages the launch was given (masked lanes excluded): an access outside them, which
  a GPU would fault on or silently corrupt, is kind ``bounds``.
* ``variant``: ``skip_launches`` runs the plan without its kernels (rule D003: outputs
  that still match did not need them); ``config`` picks each autotuned launch's config.
  An autotuned launch with several configs runs as the GPU autotuner runs it: once
  as a benchmark (``reset_to_zero`` arguments zeroed, ``restore_value`` arguments
  restored after), then, after zeroing again, for real.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from services.sandbox import values
from services.sandbox.values import TensorRef
from services.worker.rules import ALLOWED_OPS, op_packet
from services.worker.trace import UNDEFINED_ALLOCATIONS, code_end_line, fill_undefined
from services.worker.traffic import ELEMENTWISE_FLOPS, LaunchTraffic, dot_dtype, op_traffic


class ReplayError(Exception):
    """The plan could not be replayed. ``kind``: ``trace`` (it does not describe a run),
    ``compute`` (a PyTorch compute operator), ``bounds`` (a kernel accessed memory
    outside its arguments), ``kernel`` (a kernel raised: ``cause`` holds the
    exception, ``kernel`` its name)."""

    def __init__(self, kind: str, message: str, *, kernel: str | None = None,
                 cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.kernel = kernel
        self.cause = cause


@dataclass(frozen=True)
class Variant:
    """How to replay: ``skip_launches`` (D003), ``config`` (index into each autotuned
    launch's configs, modulo their number; None: the one the planner chose)."""

    skip_launches: bool = False
    config: int | None = None


# ---------------------------------------------------------------- bounds (interpreter)


class _Bounds:
    """A stand-in for ``triton._C.libtriton.interpreter`` that checks every address a
    kernel loads from or stores to against the storages of the running launch."""

    def __init__(self, native: Any) -> None:
        self._native = native
        self.ranges: list[tuple[int, int, str]] = []
        self._starts: list[int] = []
        self.kernel = ""
        # The running launch's counts (None: not counting), see services.worker.traffic.
        self.count: LaunchTraffic | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._native, name)

    def set_ranges(self, ranges: list[tuple[int, int, str]], kernel: str) -> None:
        self.ranges = sorted(ranges)
        self._starts = [r[0] for r in self.ranges]
        self.kernel = kernel

    def _check(self, ptrs: np.ndarray, mask: np.ndarray | None, itemsize: int, what: str) -> None:
        addresses = np.asarray(ptrs, dtype=np.uint64).reshape(-1)
        if mask is not None:
            keep = np.asarray(mask, dtype=bool)
            if not keep.all():
                addresses = addresses[np.broadcast_to(keep, np.shape(ptrs)).reshape(-1)]
        count = self.count
        if count is not None:
            moved = int(addresses.size) * itemsize
            if what == "loaded":
                count.loaded += moved
            elif what == "stored":
                count.stored += moved
            else:
                count.atomic += moved
        if addresses.size == 0:
            return
        if self.ranges:
            # Most accesses fall in one argument: its bounds against the lowest and the
            # highest address decide at once.
            low, high = int(addresses.min()), int(addresses.max())
            position = bisect.bisect_right(self._starts, low) - 1
            if position >= 0 and high + itemsize <= self.ranges[position][1]:
                return
        if not self.ranges:
            raise ReplayError("bounds", f"kernel {self.kernel} {what} memory but was given "
                              "no tensor", kernel=self.kernel)
        starts = np.asarray(self._starts, dtype=np.uint64)
        ends = np.asarray([r[1] for r in self.ranges], dtype=np.uint64)
        index = np.searchsorted(starts, addresses, side="right").astype(np.int64) - 1
        ok = index >= 0
        inside = np.zeros(addresses.shape, dtype=bool)
        inside[ok] = addresses[ok] + np.uint64(itemsize) <= ends[index[ok]]
        if bool(inside.all()):
            return
        bad = int(addresses[~inside][0])
        position = bisect.bisect_right(self._starts, bad) - 1
        if position >= 0:
            start, end, name = self.ranges[position]
            where = f"{bad - end + itemsize} bytes past the end of argument {name}" \
                if bad >= start else f"before argument {name}"
        else:
            start, _, name = self.ranges[0]
            where = f"{start - bad} bytes before argument {name}"
        count = int((~inside).sum())
        raise ReplayError("bounds", f"kernel {self.kernel} {what} out of bounds: {count} "
                          f"access(es), the first {where} (on a GPU this faults or corrupts "
                          "other memory; mask the access)", kernel=self.kernel)

    def load(self, ptrs, mask, other, dtype):  # noqa: ANN001
        self._check(ptrs, mask, np.dtype(dtype).itemsize, "loaded")
        return self._native.load(ptrs, mask, other, dtype)

    def store(self, ptrs, value, mask):  # noqa: ANN001
        self._check(ptrs, mask, np.asarray(value).dtype.itemsize, "stored")
        return self._native.store(ptrs, value, mask)

    def atomic_rmw(self, op, ptrs, value, mask, sem):  # noqa: ANN001
        self._check(ptrs, mask, np.asarray(value).dtype.itemsize, "did an atomic")
        return self._native.atomic_rmw(op, ptrs, value, mask, sem)

    def atomic_cas(self, ptrs, cmp, value, sem):  # noqa: ANN001
        self._check(ptrs, None, np.asarray(value).dtype.itemsize, "did an atomic")
        return self._native.atomic_cas(ptrs, cmp, value, sem)


def install_bounds_checks() -> _Bounds:
    """Route the interpreter's memory accesses through a :class:`_Bounds` (this process),
    and count each launch's FLOPs on it (:func:`_count_flops`)."""
    from triton.runtime import interpreter

    if not isinstance(interpreter._interpreter, _Bounds):
        interpreter._interpreter = _Bounds(interpreter._interpreter)
        _count_flops(interpreter._interpreter)
    return interpreter._interpreter


def _count_flops(bounds: _Bounds) -> None:
    """Wrap the interpreter builder's ``tl.dot`` and floating-point element-wise methods
    so that each adds its FLOPs to ``bounds.count`` (see :mod:`services.worker.traffic`)."""
    from triton.runtime.interpreter import InterpreterBuilder

    def elementwise(original: Any, per_lane: int) -> Any:
        def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(self, *args, **kwargs)
            count = bounds.count
            data = getattr(out, "data", None)
            if count is not None and isinstance(data, np.ndarray) and \
                    np.issubdtype(data.dtype, np.floating):
                count.flops += per_lane * int(data.size)
            return out
        return counted

    for name, per_lane in ELEMENTWISE_FLOPS.items():
        original = getattr(InterpreterBuilder, name, None)
        if original is not None:
            setattr(InterpreterBuilder, name, elementwise(original, per_lane))

    original_dot = InterpreterBuilder.create_dot

    def create_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, *rest: Any) -> Any:
        out = original_dot(self, a, b, d, input_precision, *rest)
        count = bounds.count
        if count is not None:
            m, k = a.data.shape[-2:]
            n = b.data.shape[-1]
            batch = int(np.prod(a.data.shape[:-2])) if a.data.ndim > 2 else 1
            ieee = "ieee" in str(input_precision).lower()
            key = dot_dtype(getattr(getattr(a, "dtype", None), "name", None)
                            or str(a.data.dtype), ieee)
            count.dot_flops[key] = count.dot_flops.get(key, 0) + 2 * batch * m * n * k
        return out

    InterpreterBuilder.create_dot = create_dot


# ---------------------------------------------------------------- the replayer


def resolve_ops() -> dict[str, Any]:
    """Every overload of every allowlisted ATen operator, by full name
    (``aten.view.default`` -> its ``OpOverload``), resolved now: taken before the
    candidate's kernel module is loaded, so a later change to ``torch.ops.aten`` (or to
    the allowlist) does not change what a plan's operator names run."""
    table: dict[str, Any] = {}
    for packet_name in sorted(ALLOWED_OPS):
        packet = getattr(torch.ops.aten, packet_name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            table[f"aten.{packet_name}.{overload}"] = getattr(packet, overload)
    return table


class Replayer:
    """Executes recorded calls, keeping storages from one call to the next (a candidate
    may keep buffers between calls), as the planner's process did.

    Args:
        kernels: name -> the candidate's ``@triton.jit`` function (from the module
            :func:`services.worker.kernel_source.kernel_module` wrote).
        device: where to replay (``cpu`` on the interpreter, ``cuda:0`` ...).
        bounds: the interpreter's bounds checker (None: unchecked, e.g. on a GPU).
        ops: the operators a plan may name (:func:`resolve_ops`; default: resolved now).
    """

    def __init__(self, kernels: dict[str, Any], device: torch.device,
                 bounds: _Bounds | None = None, ops: dict[str, Any] | None = None) -> None:
        self.kernels = kernels
        self.device = device
        self.bounds = bounds
        self.ops = ops if ops is not None else resolve_ops()
        self.storages: dict[int, Any] = {}
        self.launches = 0
        # The current call's launches, counted (the interpreter's only; empty on a GPU),
        # and the captured storages its launches were given (storage id -> bytes).
        self.traffic: list[LaunchTraffic] = []
        self.captured_used: dict[int, int] = {}
        self._captured: set[int] = set()

    # ------------------------------------------------------------ storages

    def add_storage(self, storage_id: int, data: bytes | bytearray | memoryview) -> None:
        """A captured storage: its bytes as the planner first saw them."""
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else \
            torch.empty(0, dtype=torch.uint8)
        self.storages[storage_id] = raw.to(self.device).untyped_storage()
        self._captured.add(storage_id)

    def add_input(self, ref: TensorRef, value: torch.Tensor) -> None:
        """An input: the real tensor in place of the decoy the planner saw."""
        if tuple(value.shape) != ref.shape or values.dtype_name(value.dtype) != ref.dtype:
            raise ReplayError("trace", f"the plan's input has shape {ref.shape} and dtype "
                              f"{ref.dtype}; the real input has {tuple(value.shape)} and "
                              f"{values.dtype_name(value.dtype)}")
        copy = torch.empty_strided(ref.shape, ref.stride, dtype=value.dtype,
                                   device=self.device)
        copy.copy_(value)
        if ref.offset != 0:
            raise ReplayError("trace", "an input must start at its storage's beginning")
        self.storages[ref.storage] = copy.untyped_storage()

    def tensor(self, ref: TensorRef) -> torch.Tensor:
        """The view ``ref`` names.

        Raises:
            ReplayError: (trace) an unknown storage, or a view past its end.
        """
        storage = self.storages.get(ref.storage)
        if storage is None:
            raise ReplayError("trace", f"a tensor of shape {list(ref.shape)} views storage "
                              f"{ref.storage}, which the plan neither made nor captured "
                              "(made outside the recorded operators?)")
        low, high = ref.span_bytes()
        if high > storage.nbytes() or low < 0:
            raise ReplayError("trace", f"a tensor of shape {list(ref.shape)} reaches byte "
                              f"{high} of a {storage.nbytes()}-byte storage")
        dtype = values.dtype_from_name(ref.dtype)
        return torch.empty(0, dtype=dtype, device=self.device).set_(
            storage, ref.offset, ref.shape, ref.stride)

    def decode(self, tree: Any) -> Any:
        return values.decode(tree, self.tensor, device=self.device)

    # ------------------------------------------------------------ calls

    def run(self, events: list[Any], variant: Variant = Variant()) -> None:
        """Execute one call's events in order.

        Raises:
            ReplayError: see the class doc.
        """
        self.traffic = []
        self.captured_used = {}
        for event in events:
            if not isinstance(event, dict):
                raise ReplayError("trace", "a malformed event in the plan")
            if "op" in event:
                self._op(event)
            elif "launch" in event:
                if not variant.skip_launches:
                    self._launch(event, variant)
            else:
                raise ReplayError("trace", f"an unknown event in the plan: {sorted(event)[:3]}")

    def outputs(self, tree: Any) -> list[torch.Tensor]:
        """The call's outputs (the recorded output tree), as contiguous CPU tensors."""
        got = self.decode(tree)
        items = list(got) if isinstance(got, (list, tuple)) else [got]
        out = []
        for item in items:
            if not isinstance(item, torch.Tensor):
                raise ReplayError("trace", "the plan's outputs hold a non-tensor")
            out.append(item.detach().to("cpu").contiguous().clone())
        return out

    def _op(self, event: dict[str, Any]) -> None:
        name = str(event.get("op"))
        parts = name.split(".")
        if len(parts) != 3 or parts[0] != "aten":
            raise ReplayError("trace", f"an operator name the plan cannot hold: {name!r}")
        op = self.ops.get(name)
        if op is None:
            if op_packet(name) not in ALLOWED_OPS:
                raise ReplayError("compute", f"{name} (PyTorch compute) ran in "
                                  "ModelNew.forward")
            raise ReplayError("trace", f"no ATen operator {name}")
        args = self.decode(event.get("args", []))
        kwargs = self.decode(event.get("kwargs", {}))
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise ReplayError("trace", f"malformed arguments of {name}")
        try:
            out = op(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the plan's arguments are untrusted
            raise ReplayError("trace", f"{name} failed on the plan's arguments: "
                              f"{type(exc).__name__}: {str(exc)[:300]}") from None
        self._bind_outputs(name, out, event.get("out"))
        if parts[1] in UNDEFINED_ALLOCATIONS:
            for t in values.flat_tensors(out):
                fill_undefined(t)
        elif self.bounds is not None:
            moved = op_traffic(op, args, kwargs, out)
            if moved is not None:
                self.traffic.append(LaunchTraffic(kernel=name, loaded=moved[0],
                                                  stored=moved[1]))

    def _bind_outputs(self, name: str, got: Any, recorded: Any) -> None:
        """Match an op's outputs with the recorded ones: new storages take the recorded
        ids, known ones must be the ones recorded, every view's layout must agree."""
        if isinstance(recorded, dict) and recorded.get(values.TAG) == "T":
            if not isinstance(got, torch.Tensor):
                raise ReplayError("trace", f"{name} returned {type(got).__name__}; the plan "
                                  "recorded a tensor")
            ref = values.decode(recorded, lambda r: r)
            storage = got.untyped_storage()
            known = self.storages.get(ref.storage)
            if known is None:
                self.storages[ref.storage] = storage
            elif known._cdata != storage._cdata:
                raise ReplayError("trace", f"{name} returned a tensor of another storage "
                                  "than the plan recorded")
            layout = (int(got.storage_offset()), tuple(got.shape), tuple(got.stride()),
                      values.dtype_name(got.dtype))
            if layout != (ref.offset, ref.shape, ref.stride, ref.dtype):
                raise ReplayError("trace", f"{name} gave shape {list(got.shape)}, strides "
                                  f"{list(got.stride())}, dtype {layout[3]}; the plan "
                                  f"recorded {list(ref.shape)}, {list(ref.stride)}, "
                                  f"{ref.dtype}")
            return
        if isinstance(recorded, dict) and recorded.get(values.TAG) == "tuple":
            recorded = recorded.get("v", [])
        if isinstance(recorded, list):
            if not isinstance(got, (list, tuple)) or len(got) != len(recorded):
                raise ReplayError("trace", f"{name} returned another number of outputs "
                                  "than the plan recorded")
            for g, r in zip(got, recorded, strict=True):
                self._bind_outputs(name, g, r)

    # ------------------------------------------------------------ launches

    def _launch(self, event: dict[str, Any], variant: Variant) -> None:
        name = str(event.get("launch"))
        fn = self.kernels.get(name)
        line = event.get("line")
        if fn is None or getattr(getattr(fn, "fn", None), "__code__", None) is None \
                or code_end_line(fn.fn.__code__) != line:
            raise ReplayError("trace", f"forward launched {name} (ending at line {line}), "
                              "which is not a module-level @triton.jit function of the "
                              "candidate; define every kernel at module level with "
                              "@triton.jit")
        tune = event.get("autotune")
        runs = [event]
        if isinstance(tune, dict):
            if tune.get("hooks"):
                raise ReplayError("trace", f"{name} is autotuned with pre_hook/post_hook "
                                  "functions, which cannot be checked; use reset_to_zero / "
                                  "restore_value")
            variants = tune.get("variants") or [event]
            choice = tune.get("chosen", 0) if variant.config is None else variant.config
            chosen = variants[int(choice) % len(variants)]
            runs = [chosen, chosen] if len(variants) > 1 else [chosen]
        for number, run in enumerate(runs):
            # Several configs: a benchmark run, then the real one (both from zeroed
            # reset_to_zero arguments), as the GPU autotuner does.
            multi = len(runs) == 2
            self._run_kernel(fn, name, run, tune if multi else None, multi and number == 0)

    def _run_kernel(self, fn: Any, name: str, run: dict[str, Any],
                    tune: dict[str, Any] | None, benchmark: bool) -> None:
        args = self.decode(run.get("args", {}))
        grid = run.get("grid")
        if not isinstance(args, dict) or not isinstance(grid, list) or not 1 <= len(grid) <= 3 \
                or not all(isinstance(g, int) and g >= 0 for g in grid):
            raise ReplayError("trace", f"malformed launch of {name}")
        options = {k: v for k, v in (run.get("options") or {}).items() if isinstance(k, str)}
        saved = {}
        if tune is not None:
            for arg in tune.get("reset_to_zero", []):
                if isinstance(args.get(arg), torch.Tensor):
                    args[arg].zero_()
        if benchmark:
            saved = {arg: args[arg].clone() for arg in (tune or {}).get("restore_value", [])
                     if isinstance(args.get(arg), torch.Tensor)}
        # The benchmark run of an autotuned launch is not counted: a GPU runs it once
        # per config ever, not in every call.
        launch = LaunchTraffic(kernel=name) if self.bounds is not None and not benchmark \
            else None
        if launch is not None:
            self._note_captured(args)
        with self._checked(name, args, launch):
            try:
                fn[tuple(grid)](**args, **options)
            except ReplayError:
                raise
            except Exception as exc:  # noqa: BLE001 - the candidate's kernel
                inner = _unwrap(exc)
                if isinstance(inner, ReplayError):
                    raise inner from None
                raise ReplayError("kernel", f"{type(inner).__name__}: {inner}", kernel=name,
                                  cause=exc) from None
        if launch is not None:
            self.traffic.append(launch)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        for arg, value in saved.items():
            args[arg].copy_(value)
        self.launches += 1

    def _note_captured(self, args: dict[str, Any]) -> None:
        """Remember the captured storages (parameters, buffers) a launch was given: each
        is read at least once by a minimal kernel (``bytes_min``)."""
        for storage_id in self._captured:
            storage = self.storages.get(storage_id)
            if storage is None or storage_id in self.captured_used:
                continue
            for value in args.values():
                for t in values.flat_tensors(value):
                    if t.untyped_storage()._cdata == storage._cdata:
                        self.captured_used[storage_id] = storage.nbytes()

    @contextlib.contextmanager
    def _checked(self, name: str, args: dict[str, Any],
                 launch: LaunchTraffic | None = None) -> Iterator[None]:
        if self.bounds is None:
            yield
            return
        ranges = []
        for arg, value in args.items():
            for t in values.flat_tensors(value):
                storage = t.untyped_storage()
                if storage.nbytes():
                    ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes(),
                                   arg))
        self.bounds.set_ranges(ranges, name)
        self.bounds.count = launch
        try:
            yield
        finally:
            self.bounds.set_ranges([], "")
            self.bounds.count = None


def _unwrap(exc: BaseException) -> BaseException:
    """The kernel's own exception inside the interpreter's InterpreterError wrapper."""
    from triton.runtime.errors import InterpreterError

    while isinstance(exc, InterpreterError) and exc.__cause__ is not None:
        exc = exc.__cause__
    return exc
