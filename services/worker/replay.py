"""Run a candidate's recorded launch plan on the real inputs: the replayer child's work.

The planner (:mod:`services.worker.trace`) recorded, on decoys, every ATen operator and
Triton launch of ``forward``. :class:`Replayer` executes that plan in a process that
never runs the candidate's Python: only the operators of
:data:`services.worker.rules.ALLOWED_OPS` (allocation, views, layout and dtype copies),
through ``torch.ops.aten``, and the candidate's ``@triton.jit`` kernels, loaded from a
module that holds nothing else (:mod:`services.worker.kernel_source`). Its outputs are
what the worker compares with the reference.

* Undefined allocations (``empty`` ...) are filled as the request's secret fill says
  (:class:`services.worker.trace.Fill`: NaN, signalling-NaN patterns, large or random
  finite values, zeros, per element mixed), so an output no kernel wrote cannot match,
  and what a kernel reads from one it never wrote changes from one replay to the next.
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
  An autotuned launch with several configs runs as the GPU autotuner runs it: as a
  benchmark (``reset_to_zero`` arguments zeroed, ``restore_value`` arguments restored
  after) ``autotune_runs - 1`` times (the worker's secret count: a GPU's autotuner
  benchmarks a config as often as its time budget allows), then, after zeroing
  again, for real.
* ``order_seed`` (on the interpreter): every launch of more than one program also runs
  from the same starting memory with its programs in reverse order, in an order drawn
  from the seed, and concurrently (:class:`_Concurrent`); when what it leaves in memory
  differs from program order the launch races (:class:`ReplayError` kind ``race``).
  Program order's results are kept.

Why other orders (rule D021): the interpreter runs a launch's programs one after
another, each seeing every store of the ones before. A GPU promises neither: "thread
blocks are required to execute independently: it must be possible to execute them in
any order, in parallel or in series" (CUDA C++ Programming Guide, Thread Hierarchy),
and a store of one block is only guaranteed visible to another block that observes it
through synchronization: an atomic with acquire semantics reading a value written by
a release (or a fence) after it (the Guide's Memory Fence Functions and the PTX ISA
memory consistency model: morally strong operations, release/acquire patterns).
Triton's ``tl.atomic_*`` take ``sem`` (``acq_rel`` by default, ``acquire``,
``release``, ``relaxed``) with those PTX meanings; its plain ``tl.load``/``tl.store``
are weak. Hence the concurrent model: a program's plain loads see memory as the launch
began, except what it stored itself; atomics act on live memory; an atomic with
release semantics publishes the program's stores so far, one with acquire semantics
lets the program's later loads see everything published. A read-modify-write without
atomics (lost updates), a program reading another's output, or "the last program
reduces the partials" without an acquiring counter give other memory there, or in
another order, than in program order. Floating-point atomic adds may round differently
in another order: their elements may differ by the recursive-summation bound
``2 n eps (sum |x_i| + |result|)`` (Higham, Accuracy and Stability of Numerical
Algorithms, 2nd ed., section 4.2), every other element must be equal (NaN equal to
NaN).
"""

from __future__ import annotations

import bisect
import contextlib
import inspect
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from services.sandbox import values
from services.sandbox.values import TensorRef
from services.worker.rules import ALLOWED_OPS, op_packet
from services.worker.trace import UNDEFINED_ALLOCATIONS, Fill, code_end_line, fill_undefined
from services.worker.traffic import ELEMENTWISE_FLOPS, LaunchTraffic, dot_dtype, op_traffic


class ReplayError(Exception):
    """The plan could not be replayed. ``kind``: ``trace`` (it does not describe a run),
    ``compute`` (a PyTorch compute operator), ``bounds`` (a kernel accessed memory
    outside its arguments), ``kernel`` (a kernel raised: ``cause`` holds the
    exception, ``kernel`` its name), ``race`` (a launch's results depend on the order
    its programs ran), ``spin`` (in another order than program order, a program kept
    accessing memory far past what any program did in program order: it waits on
    another)."""

    def __init__(self, kind: str, message: str, *, kernel: str | None = None,
                 cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.kernel = kernel
        self.cause = cause


@dataclass(frozen=True)
class Variant:
    """How to replay: ``skip_launches`` (D003), ``config`` (index into each autotuned
    launch's configs, modulo their number; None: the one the planner chose),
    ``fill_kind``/``fill_seed`` (fresh allocations, :class:`services.worker.trace.Fill`;
    seed None: the fixed fill), ``order_seed`` (run launches in other orders too; see
    the module doc), ``autotune_runs`` (runs of each config of a multi-config
    autotuned launch, at least 2: benchmark runs, then the real one)."""

    skip_launches: bool = False
    config: int | None = None
    fill_kind: str = "nan"
    fill_seed: int | None = None
    order_seed: int | None = None
    autotune_runs: int = 2


# ---------------------------------------------------------------- bounds (interpreter)


# Loaded elements a launch may reach before its distinct bytes are no longer tracked
# (8 bytes of address each: 64 MiB).
_UNIQUE_CAP = 1 << 23


class _Bounds:
    """A stand-in for ``triton._C.libtriton.interpreter`` that checks every address a
    kernel loads from or stores to against the storages of the running launch."""

    def __init__(self, native: Any) -> None:
        self._native = native
        self.ranges: list[tuple[int, int, str]] = []
        self._starts: list[int] = []
        self.kernel = ""
        # The running launch's counts (None: not counting), see services.worker.traffic;
        # the addresses its loads reached, by element size (None: past _UNIQUE_CAP), for
        # its unique_loaded, filled in when counting moves on (the count setter).
        self._count: LaunchTraffic | None = None
        self._loads: dict[int, list[np.ndarray]] | None = {}
        self._load_elements = 0
        # Other orders (see the module doc): run position -> program (x, y, z) (None:
        # program order), the concurrent model (None: every store visible at once).
        self.order: list[tuple[int, int, int]] | None = None
        self.concurrent: _Concurrent | None = None
        # Memory accesses of the running program, the most of any program in program
        # order, the bound past which a program spins (None: no bound).
        self.program_ops = 0
        self.ops_max = 0
        self.ops_cap: int | None = None
        self.program: tuple[int, int, int] = (0, 0, 0)
        # Floating-point atomic adds of the launch (addresses, |operand|), when tracked.
        self.atomic_adds: list[tuple[np.ndarray, np.ndarray]] | None = None
        # The semantics of the atomic load/store running (None: a plain access).
        self.atomic_sem: str | None = None

    @property
    def count(self) -> LaunchTraffic | None:
        return self._count

    @count.setter
    def count(self, value: LaunchTraffic | None) -> None:
        previous = self._count
        if previous is not None and previous is not value:
            if self._loads is not None:
                previous.unique_loaded = sum(
                    int(np.unique(np.concatenate(parts)).size) * itemsize
                    for itemsize, parts in self._loads.items())
        self._count = value
        self._loads, self._load_elements = {}, 0

    def start_program(self, program: tuple[int, int, int]) -> None:
        """A program of the running launch starts (the interpreter's grid loop)."""
        self.ops_max = max(self.ops_max, self.program_ops)
        self.program_ops = 0
        self.program = program
        if self.concurrent is not None:
            self.concurrent.start_program()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._native, name)

    def set_ranges(self, ranges: list[tuple[int, int, str]], kernel: str) -> None:
        self.ranges = sorted(ranges)
        self._starts = [r[0] for r in self.ranges]
        self.kernel = kernel

    def _check(self, ptrs: np.ndarray, mask: np.ndarray | None, itemsize: int,
               what: str) -> np.ndarray:
        """The addresses the access reaches (masked lanes dropped), bounds-checked."""
        addresses = np.asarray(ptrs, dtype=np.uint64).reshape(-1)
        if mask is not None:
            keep = np.asarray(mask, dtype=bool)
            if not keep.all():
                addresses = addresses[np.broadcast_to(keep, np.shape(ptrs)).reshape(-1)]
        self.program_ops += 1
        if self.ops_cap is not None and self.program_ops > self.ops_cap:
            raise ReplayError("spin", f"program {self.program} of kernel {self.kernel} made "
                              f"more than {self.ops_cap} memory accesses, far more than any "
                              "program made in program order: it waits for memory that "
                              "another program writes", kernel=self.kernel)
        count = self.count
        if count is not None:
            moved = int(addresses.size) * itemsize
            if what == "loaded":
                count.loaded += moved
                if self._loads is not None:
                    self._load_elements += int(addresses.size)
                    if self._load_elements > _UNIQUE_CAP:
                        self._loads = None  # unique_loaded stays 0: not known
                    else:
                        self._loads.setdefault(itemsize, []).append(addresses)
            elif what == "stored":
                count.stored += moved
            else:
                count.atomic += moved
        if addresses.size == 0:
            return addresses
        if self.ranges:
            # Most accesses fall in one argument: its bounds against the lowest and the
            # highest address decide at once.
            low, high = int(addresses.min()), int(addresses.max())
            position = bisect.bisect_right(self._starts, low) - 1
            if position >= 0 and high + itemsize <= self.ranges[position][1]:
                return addresses
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
            return addresses
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
        itemsize = np.dtype(dtype).itemsize
        self._check(ptrs, mask, itemsize, "loaded")
        out = self._native.load(ptrs, mask, other, dtype)
        concurrent = self.concurrent
        if concurrent is not None:
            if self.atomic_sem is not None:
                concurrent.atomic(ptrs, mask, itemsize, self.atomic_sem, wrote=False)
            else:
                out = concurrent.load(ptrs, mask, itemsize, out)
        return out

    def store(self, ptrs, value, mask):  # noqa: ANN001
        itemsize = np.asarray(value).dtype.itemsize
        self._check(ptrs, mask, itemsize, "stored")
        out = self._native.store(ptrs, value, mask)
        if self.concurrent is not None:
            if self.atomic_sem is not None:
                self.concurrent.atomic(ptrs, mask, itemsize, self.atomic_sem, wrote=True)
            else:
                self.concurrent.stored(ptrs, mask, itemsize)
        return out

    def atomic_rmw(self, op, ptrs, value, mask, sem):  # noqa: ANN001
        itemsize = np.asarray(value).dtype.itemsize
        addresses = self._check(ptrs, mask, itemsize, "did an atomic")
        out = self._native.atomic_rmw(op, ptrs, value, mask, sem)
        if self.atomic_adds is not None and "ADD" in getattr(op, "name", str(op)) and \
                np.issubdtype(np.asarray(value).dtype, np.floating) and addresses.size:
            operand = np.abs(np.broadcast_to(np.asarray(value, dtype=np.float64),
                                             np.shape(ptrs)).reshape(-1))
            if mask is not None:
                operand = operand[np.broadcast_to(np.asarray(mask, dtype=bool),
                                                  np.shape(ptrs)).reshape(-1)]
            self.atomic_adds.append((addresses, operand))
        if self.concurrent is not None:
            self.concurrent.atomic(ptrs, mask, itemsize, _sem_name(sem), wrote=True)
        return out

    def atomic_cas(self, ptrs, cmp, value, sem):  # noqa: ANN001
        itemsize = np.asarray(value).dtype.itemsize
        self._check(ptrs, None, itemsize, "did an atomic")
        out = self._native.atomic_cas(ptrs, cmp, value, sem)
        if self.concurrent is not None:
            self.concurrent.atomic(ptrs, None, itemsize, _sem_name(sem), wrote=True)
        return out


def _sem_name(sem: Any) -> str:
    """``MEM_SEMANTIC.ACQUIRE_RELEASE`` -> ``ACQUIRE_RELEASE`` (the interpreter's enum or
    the IR's)."""
    return str(getattr(sem, "name", sem)).rsplit(".", 1)[-1].upper()


class _Concurrent:
    """The memory a launch's programs see when they run at once (module doc, rule
    D021): each program's plain loads read memory as the launch began (``base``),
    except bytes the program itself stored or reached with an atomic (live memory);
    after an atomic with acquire semantics they read what programs published
    (``published``: ``base`` updated, at each atomic with release semantics, with
    the releasing program's stores, and with every atomic's result).

    Args:
        storages: the launch's storages (each once), live memory.
    """

    def __init__(self, storages: list[Any]) -> None:
        views = sorted(((s.data_ptr(), _bytes_view(s)) for s in storages if s.nbytes()),
                       key=lambda item: item[0])
        self.starts = np.asarray([start for start, _ in views], dtype=np.uint64)
        self.live = [view for _, view in views]
        self.base = [view.copy() for view in self.live]
        self.published = [view.copy() for view in self.live]
        self.own = [np.zeros(view.size, dtype=bool) for view in self.live]
        self.touched: set[int] = set()
        self.acquired = False

    def start_program(self) -> None:
        for r in self.touched:
            self.own[r][:] = False
        self.touched.clear()
        self.acquired = False

    def _lanes(self, ptrs: Any, mask: Any, itemsize: int
               ) -> tuple[np.ndarray, list[tuple[int, np.ndarray, np.ndarray]]]:
        """The access's lanes (positions in the flat access) that are not masked, by
        storage: (storage index, lane positions, byte offsets (lanes x itemsize))."""
        addresses = np.asarray(ptrs, dtype=np.uint64).reshape(-1)
        lanes = np.arange(addresses.size)
        if mask is not None:
            keep = np.broadcast_to(np.asarray(mask, dtype=bool), np.shape(ptrs)).reshape(-1)
            lanes = lanes[keep]
            addresses = addresses[keep]
        index = np.searchsorted(self.starts, addresses, side="right").astype(np.int64) - 1
        out = []
        for r in np.unique(index):
            if r < 0:
                continue
            pick = index == r
            offsets = (addresses[pick] - self.starts[r]).astype(np.int64)
            span = offsets[:, None] + np.arange(itemsize)
            if span.size and int(span.max()) >= self.live[r].size:
                continue
            out.append((int(r), lanes[pick], span))
        return lanes, out

    def load(self, ptrs: Any, mask: Any, itemsize: int, got: np.ndarray) -> np.ndarray:
        """``got`` (the native load's result, from live memory) with every lane this
        program may not see yet read from the memory it sees instead."""
        _, groups = self._lanes(ptrs, mask, itemsize)
        out = None
        for r, lanes, span in groups:
            hidden = ~self.own[r][span].all(axis=1)
            if not hidden.any():
                continue
            if out is None:
                out = np.array(got, copy=True)
            image = self.published[r] if self.acquired else self.base[r]
            raw = np.ascontiguousarray(image[span[hidden]])
            flat = out.reshape(-1)
            flat[lanes[hidden]] = raw.view(out.dtype).reshape(-1)
        return got if out is None else out

    def stored(self, ptrs: Any, mask: Any, itemsize: int) -> None:
        for r, _, span in self._lanes(ptrs, mask, itemsize)[1]:
            self.own[r][span] = True
            self.touched.add(r)

    def atomic(self, ptrs: Any, mask: Any, itemsize: int, sem: str, *, wrote: bool) -> None:
        """An atomic access: release publishes this program's stores first; the
        atomic's bytes are this program's and published; acquire lets later loads
        see what is published."""
        if sem in ("RELEASE", "ACQUIRE_RELEASE"):
            for r in self.touched:
                own = self.own[r]
                self.published[r][own] = self.live[r][own]
        for r, _, span in self._lanes(ptrs, mask, itemsize)[1]:
            self.own[r][span] = True
            self.touched.add(r)
            if wrote:
                self.published[r][span] = self.live[r][span]
        if sem in ("ACQUIRE", "ACQUIRE_RELEASE"):
            self.acquired = True


def _bytes_view(storage: Any) -> np.ndarray:
    """The bytes of a CPU storage as a numpy array sharing its memory."""
    return torch.empty(0, dtype=torch.uint8).set_(storage).numpy()


def install_bounds_checks() -> _Bounds:
    """Route the interpreter's memory accesses through a :class:`_Bounds` (this process),
    and count each launch's FLOPs on it (:func:`_count_flops`)."""
    from triton.runtime import interpreter

    if not isinstance(interpreter._interpreter, _Bounds):
        interpreter._interpreter = _Bounds(interpreter._interpreter)
        _count_flops(interpreter._interpreter)
        _order_programs(interpreter._interpreter)
    return interpreter._interpreter


def _order_programs(bounds: _Bounds) -> None:
    """Let ``bounds`` choose the order of a launch's programs: the interpreter's grid
    loop (``GridExecutor.__call__``) sets each program's index with
    ``InterpreterBuilder.set_grid_idx`` in program order; the ``n``-th call sets the
    ``n``-th program of ``bounds.order`` instead. Atomic loads and stores (which the
    interpreter runs as plain ones) are marked with their semantics for the
    concurrent model."""
    from triton.runtime.interpreter import InterpreterBuilder

    original = InterpreterBuilder.set_grid_idx

    def set_grid_idx(self: Any, x: int, y: int, z: int) -> Any:
        order = bounds.order
        if order is not None:
            _, gy, gz = self.grid_dim
            x, y, z = order[(x * gy + y) * gz + z]
        bounds.start_program((x, y, z))
        return original(self, x, y, z)

    InterpreterBuilder.set_grid_idx = set_grid_idx
    for name in ("create_atomic_load", "create_atomic_store"):
        method = getattr(InterpreterBuilder, name, None)
        if method is None:
            continue

        def atomic(self: Any, *args: Any, _method: Any = method, **kwargs: Any) -> Any:
            arguments = inspect.signature(_method).bind(self, *args, **kwargs).arguments
            previous = bounds.atomic_sem
            bounds.atomic_sem = _sem_name(arguments.get("sem", "ACQUIRE_RELEASE"))
            try:
                return _method(self, *args, **kwargs)
            finally:
                bounds.atomic_sem = previous

        setattr(InterpreterBuilder, name, atomic)


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
            tile = [int(m), int(n), int(k), int(a.data.dtype.itemsize)]
            if not count.dot_tile or math.prod(tile[:3]) > math.prod(count.dot_tile[:3]):
                count.dot_tile = tile
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
        # The running call's variant, fill and order generator (see run).
        self._variant = Variant()
        self._fill: Fill | None = None
        self._orders: np.random.Generator | None = None

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
        self._variant = variant
        self._fill = None if variant.fill_seed is None else Fill(variant.fill_kind,
                                                                 variant.fill_seed)
        self._orders = None if variant.order_seed is None or self.bounds is None else \
            np.random.default_rng(variant.order_seed)
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
                fill_undefined(t, self._fill)
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
            runs = [chosen] * max(2, variant.autotune_runs) if len(variants) > 1 else [chosen]
        for number, run in enumerate(runs):
            # Several configs: benchmark runs, then the real one (each from zeroed
            # reset_to_zero arguments), as the GPU autotuner does.
            multi = len(runs) > 1
            self._run_kernel(fn, name, run, tune if multi else None,
                             multi and number < len(runs) - 1)

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
            launch.programs = math.prod(grid)
            for option in ("num_warps", "num_stages"):
                value = options.get(option)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    setattr(launch, option, value)
        if self._orders is not None and not benchmark and math.prod(grid) > 1:
            self._in_orders(fn, name, grid, args, options, launch)
        else:
            self._call(fn, name, grid, args, options, launch)
        if launch is not None:
            self.traffic.append(launch)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        for arg, value in saved.items():
            args[arg].copy_(value)
        self.launches += 1

    def _call(self, fn: Any, name: str, grid: list[int], args: dict[str, Any],
              options: dict[str, Any], launch: LaunchTraffic | None) -> None:
        """One launch of ``fn``, checked (on the interpreter) and counted into ``launch``."""
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

    def _in_orders(self, fn: Any, name: str, grid: list[int], args: dict[str, Any],
                   options: dict[str, Any], launch: LaunchTraffic | None) -> None:
        """The launch in program order, then from the same memory in reverse order, in
        an order drawn from the variant's seed, and concurrently (in the drawn order);
        program order's memory is kept.

        Raises:
            ReplayError: (race) another order left other values in the launch's
                storages than program order, failed, or spun; and as :meth:`_call`.
        """
        bounds = self.bounds
        assert bounds is not None and self._orders is not None
        storages: dict[int, tuple[Any, torch.dtype, str]] = {}
        for arg, value in args.items():
            for t in values.flat_tensors(value):
                storage = t.untyped_storage()
                if storage.nbytes() and storage.device.type == "cpu":
                    storages.setdefault(storage.data_ptr(), (storage, t.dtype, arg))
        items = list(storages.values())
        views = [_bytes_view(storage) for storage, _, _ in items]
        start = [view.copy() for view in views]
        bounds.atomic_adds, bounds.ops_max, bounds.program_ops = [], 0, 0
        try:
            self._call(fn, name, grid, args, options, launch)
            ops_max = max(bounds.ops_max, bounds.program_ops)
            adds = bounds.atomic_adds
        finally:
            bounds.atomic_adds = None
        first = [view.copy() for view in views]
        gx, gy, gz = (list(grid) + [1, 1])[:3]
        programs = [(x, y, z) for x in range(gx) for y in range(gy) for z in range(gz)]
        drawn = self._orders.permutation(len(programs))
        if len(programs) > 2 and (np.array_equal(drawn, np.arange(len(programs)))
                                  or np.array_equal(drawn, np.arange(len(programs))[::-1])):
            drawn = np.roll(drawn, 1)
        shuffled = [programs[int(i)] for i in drawn]
        orders = [("with its programs in reverse order", programs[::-1], False),
                  ("with its programs in a shuffled order", shuffled, False),
                  ("with its programs running concurrently (each seeing memory as the "
                   "launch began and its own stores; others' only after an acquiring "
                   "atomic)", shuffled, True)]
        try:
            for how, order, concurrent in orders:
                for view, data in zip(views, start, strict=True):
                    view[:] = data
                bounds.order = order
                bounds.concurrent = _Concurrent([s for s, _, _ in items]) if concurrent \
                    else None
                bounds.ops_cap = 4 * ops_max + 1024
                try:
                    self._call(fn, name, grid, args, options, None)
                except ReplayError as exc:
                    raise ReplayError("race", f"kernel {name}: outputs depend on the order its "
                                      f"programs ran: a race (run {how}, it failed: {exc}; "
                                      f"{_RACE_HINT})", kernel=name) from None
                finally:
                    bounds.order, bounds.concurrent, bounds.ops_cap = None, None, None
                for (storage, dtype, arg), view, want in zip(items, views, first, strict=True):
                    found = _differs(want, view, dtype, storage.data_ptr(), adds)
                    if found is not None:
                        raise ReplayError("race", f"kernel {name}: outputs depend on the order "
                                          f"its programs ran: a race (run {how}, argument "
                                          f"{arg} came out otherwise: {found}; {_RACE_HINT})",
                                          kernel=name)
        finally:
            for view, data in zip(views, first, strict=True):
                view[:] = data

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


_RACE_HINT = ("a GPU runs a launch's programs in any order and at the same time: combine "
              "what several programs update with tl.atomic_*, and read another program's "
              "results in a later launch or after an acquiring atomic that follows its "
              "release")


def _differs(want: np.ndarray, got: np.ndarray, dtype: torch.dtype, start: int,
             adds: list[tuple[np.ndarray, np.ndarray]] | None) -> str | None:
    """How the bytes ``got`` of a storage (at address ``start``, holding ``dtype``)
    differ from ``want``: None when equal (floating point: equal values, NaN equal to
    NaN; elements that floating-point atomic adds ``adds`` reached: within the
    recursive-summation bound of the module doc), else e.g. ``3 of 64 elements of its
    storage differ from program order, the first element 5: 1.5 in program order, 0.25
    in this one``."""
    if np.array_equal(want, got):
        return None
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if dtype.is_complex or want.size % itemsize:
        dtype, itemsize = torch.uint8, 1
    a = torch.from_numpy(np.ascontiguousarray(want)).view(dtype)
    b = torch.from_numpy(np.ascontiguousarray(got)).view(dtype)
    if dtype.is_floating_point:
        a64, b64 = a.double(), b.double()
        same = (a64 == b64) | (torch.isnan(a64) & torch.isnan(b64))
        if adds:
            addresses = np.concatenate([x for x, _ in adds])
            operands = np.concatenate([v for _, v in adds])
            inside = (addresses >= start) & (addresses < start + want.size)
            element = ((addresses[inside] - np.uint64(start)) // np.uint64(itemsize)).astype(
                np.int64)
            count = np.bincount(element, minlength=a.numel())[:a.numel()]
            total = np.bincount(element, weights=operands[inside], minlength=a.numel())[
                :a.numel()]
            bound = torch.from_numpy(2.0 * count * torch.finfo(dtype).eps * (
                total + np.abs(np.nan_to_num(a64.numpy(), posinf=0.0, neginf=0.0))))
            same |= (a64 - b64).abs() <= bound
    else:
        same = a == b
    wrong = (~same).nonzero().reshape(-1)
    if wrong.numel() == 0:
        return None
    i = int(wrong[0])
    return (f"{wrong.numel()} of {a.numel()} elements of its storage differ from program "
            f"order, the first element {i}: {a[i].item()!r} in program order, "
            f"{b[i].item()!r} in this one")


def _unwrap(exc: BaseException) -> BaseException:
    """The kernel's own exception inside the interpreter's InterpreterError wrapper."""
    from triton.runtime.errors import InterpreterError

    while isinstance(exc, InterpreterError) and exc.__cause__ is not None:
        exc = exc.__cause__
    return exc
