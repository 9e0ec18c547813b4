"""How a replay on Triton's interpreter sees memory (:mod:`services.worker.replay`'s
module doc gives the rules): every load, store and atomic checked against the storages
of the running launch (:class:`Bounds`, installed in place of the interpreter's own by
:func:`install_bounds_checks`), the memory a launch's programs see when they run at
once (:class:`Concurrent`, rule D021), the order the interpreter runs programs in
(:func:`_order_programs`), and each launch's FLOPs (:func:`_count_flops`). A fault is
a :class:`ReplayError`.
"""

from __future__ import annotations

import bisect
import inspect
import math
import os
import sys
from typing import Any

import numpy as np
import torch

from services.worker.traffic import ELEMENTWISE_FLOPS, LaunchTraffic, dot_dtype


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


# ---------------------------------------------------------------- bounds (interpreter)


# Loaded elements a launch may reach before its distinct bytes are no longer tracked
# (8 bytes of address each: 64 MiB).
_UNIQUE_CAP = 1 << 23
# Kinds of out-of-bounds access of one argument and line named in a bounds error before
# the rest are counted as "more".
_FAULTS_SHOWN = 6
# The plural noun of each kind of access (_check's ``what``).
_ACCESS_NOUNS = {"loaded": "load", "stored": "store", "did an atomic": "atomic"}


class Bounds:
    """A stand-in for ``triton._C.libtriton.interpreter`` that checks every address a
    kernel loads from or stores to against the storages of the running launch."""

    def __init__(self, native: Any) -> None:
        self._native = native
        self.ranges: list[tuple[int, int, str]] = []
        self._starts: list[int] = []
        self.kernel = ""
        # Where each argument's element 0 is (arg -> address; default its storage's
        # start), the kernel module's file (for the line of a fault), and the running
        # launch's out-of-bounds lanes: (argument, access, side, line) -> [lanes, first
        # element, last element]; the accesses a program may make once one faulted.
        self._origins: dict[str, int] = {}
        self.source = ""
        self.faults: dict[tuple[str, str, str, int | None], list[int]] = {}
        self._fault_cap: int | None = None
        # The running launch's counts (None: not counting), see services.worker.traffic;
        # the addresses its loads reached, by element size (None: past _UNIQUE_CAP), for
        # its unique_loaded, filled in when counting moves on (the count setter).
        self._count: LaunchTraffic | None = None
        self._loads: dict[int, list[np.ndarray]] | None = {}
        self._load_elements = 0
        # Other orders (see the module doc): run position -> program (x, y, z) (None:
        # program order), the concurrent model (None: every store visible at once).
        self.order: list[tuple[int, int, int]] | None = None
        self.concurrent: Concurrent | None = None
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

    def set_ranges(self, ranges: list[tuple[int, int, str]], kernel: str, *,
                   origins: dict[str, int] | None = None, source: str = "") -> None:
        """The running launch: its storages' byte ranges ``[start, end)`` by argument
        name, the kernel's name, where each argument's element 0 is (``origins``,
        addresses; default its storage's start) and the file the kernel was loaded from
        (``source``: a fault names its line there). Forgets the faults counted so far."""
        self.ranges = sorted(ranges)
        self._starts = [r[0] for r in self.ranges]
        self.kernel = kernel
        self._origins = dict(origins or {})
        self.source = source
        self.faults = {}
        self._fault_cap = None

    def fault_error(self, *, stopped: bool = False) -> ReplayError | None:
        """The bounds error of the running launch's out-of-bounds lanes (None: none), by
        argument, access, side and kernel line, e.g. ``kernel k accessed memory out of
        bounds: x_ptr: 768 loads past the end (elements 4096..4863), line 14 of
        candidate.py (...)``. ``stopped``: the launch was stopped before its end (a
        program kept accessing memory after its fault), so the counts are a floor."""
        if not self.faults:
            return None
        parts = []
        for (arg, what, side, line), (lanes, first, last) in list(self.faults.items())[
                :_FAULTS_SHOWN]:
            noun = _ACCESS_NOUNS.get(what, "access")
            where = f", line {line} of {os.path.basename(self.source)}" if line else ""
            parts.append(f"{arg}: {lanes} {noun}{'' if lanes == 1 else 's'} {side} "
                         f"(element{'' if first == last else 's'} "
                         f"{first}{'' if first == last else f'..{last}'}){where}")
        more = len(self.faults) - _FAULTS_SHOWN
        text = "; ".join(parts) + (f"; +{more} more" if more > 0 else "")
        floor = (" (at least: the launch was stopped once a faulting program kept "
                 "accessing memory)") if stopped else ""
        return ReplayError("bounds", f"kernel {self.kernel} accessed memory out of bounds: "
                           f"{text}{floor} (on a GPU this faults or corrupts other memory; "
                           "mask the access, e.g. mask=offs < n)", kernel=self.kernel)

    def _line(self) -> int | None:
        """The line of the kernel module (:attr:`source`) running the access: the
        innermost frame of that file (a ``@triton.jit`` helper's, when it made it)."""
        if not self.source:
            return None
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_filename == self.source:
                return frame.f_lineno
            frame = frame.f_back
        return None

    def _fault(self, bad: np.ndarray, itemsize: int, what: str) -> None:
        """Count the out-of-bounds addresses ``bad`` (uint64) of one access, each
        against the argument it is nearest to: past the end of the storage below it or
        before the start of the one above."""
        starts = np.asarray(self._starts, dtype=np.uint64)
        ends = np.asarray([r[1] for r in self.ranges], dtype=np.uint64)
        below = np.searchsorted(starts, bad, side="right").astype(np.int64) - 1
        above = below + 1
        has_below = below >= 0
        has_above = above < len(self.ranges)
        # Distances in float64: exact up to 2**53 bytes, and signed (an element that
        # starts inside a storage and ends past it).
        at = bad.astype(np.float64)
        past = np.full(bad.shape, np.inf)
        past[has_below] = at[has_below] - ends[below[has_below]].astype(np.float64)
        before = np.full(bad.shape, np.inf)
        before[has_above] = starts[above[has_above]].astype(np.float64) - at[has_above]
        use_above = before < past
        position = np.where(use_above, above, below)
        line = self._line()
        for pos, up in sorted(set(zip(position.tolist(), use_above.tolist(), strict=True))):
            pick = (position == pos) & (use_above == up)
            start, _, name = self.ranges[pos]
            origin = self._origins.get(name, start)
            low, high = int(bad[pick].min()), int(bad[pick].max())
            side = "before the start" if up else "past the end"
            key = (name, what, side, line)
            entry = self.faults.setdefault(key, [0, (low - origin) // itemsize,
                                                 (high - origin) // itemsize])
            entry[0] += int(pick.sum())
            entry[1] = min(entry[1], (low - origin) // itemsize)
            entry[2] = max(entry[2], (high - origin) // itemsize)

    def _check(self, ptrs: np.ndarray, mask: np.ndarray | None, itemsize: int,
               what: str) -> tuple[np.ndarray, np.ndarray | None]:
        """The addresses the access reaches (masked lanes dropped), bounds-checked, and
        the mask the access runs with: ``mask`` itself, or, when some lanes fall
        outside the launch's storages, one with those lanes off too. Such lanes are
        counted (:meth:`_fault`, reported by :meth:`fault_error` when the launch ends)
        and never reach memory: a masked load gives ``other`` (zero) there.

        Raises:
            ReplayError: (spin) a program accessed memory far past the bound of another
                order; (bounds) the launch was given no tensor, or a program kept
                accessing memory long after a fault (:meth:`fault_error`, a floor).
        """
        addresses = np.asarray(ptrs, dtype=np.uint64).reshape(-1)
        keep = None
        if mask is not None:
            keep = np.broadcast_to(np.asarray(mask, dtype=bool), np.shape(ptrs)).reshape(-1)
            if not keep.all():
                addresses = addresses[keep]
        self.program_ops += 1
        if self.ops_cap is not None and self.program_ops > self.ops_cap:
            raise ReplayError("spin", f"program {self.program} of kernel {self.kernel} made "
                              f"more than {self.ops_cap} memory accesses, far more than any "
                              "program made in program order: it waits for memory that "
                              "another program writes", kernel=self.kernel)
        if self._fault_cap is not None and self.program_ops > self._fault_cap:
            error = self.fault_error(stopped=True)
            assert error is not None
            raise error
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
            return addresses, mask
        if self.ranges:
            # Most accesses fall in one argument: its bounds against the lowest and the
            # highest address decide at once.
            low, high = int(addresses.min()), int(addresses.max())
            position = bisect.bisect_right(self._starts, low) - 1
            if position >= 0 and high + itemsize <= self.ranges[position][1]:
                return addresses, mask
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
            return addresses, mask
        self._fault(addresses[~inside], itemsize, what)
        if self._fault_cap is None:
            # The launch runs on so every faulting lane is counted; a program that
            # keeps accessing memory past this (it waits on a value it cannot read) is
            # stopped.
            self._fault_cap = 4 * max(self.ops_max, self.program_ops) + 1024
        lanes = np.arange(np.size(ptrs)) if keep is None else np.flatnonzero(keep)
        runs = np.ones(np.size(ptrs), dtype=bool) if keep is None else keep.copy()
        runs[lanes[~inside]] = False
        return addresses[inside], runs.reshape(np.shape(ptrs))

    def load(self, ptrs, mask, other, dtype):  # noqa: ANN001
        itemsize = np.dtype(dtype).itemsize
        _, mask = self._check(ptrs, mask, itemsize, "loaded")
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
        _, mask = self._check(ptrs, mask, itemsize, "stored")
        out = self._native.store(ptrs, value, mask)
        if self.concurrent is not None:
            if self.atomic_sem is not None:
                self.concurrent.atomic(ptrs, mask, itemsize, self.atomic_sem, wrote=True)
            else:
                self.concurrent.stored(ptrs, mask, itemsize)
        return out

    def atomic_rmw(self, op, ptrs, value, mask, sem):  # noqa: ANN001
        itemsize = np.asarray(value).dtype.itemsize
        addresses, mask = self._check(ptrs, mask, itemsize, "did an atomic")
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
        _, runs = self._check(ptrs, None, itemsize, "did an atomic")
        if runs is None:
            out = self._native.atomic_cas(ptrs, cmp, value, sem)
        else:
            # No mask in the native compare-and-swap: it runs on the lanes in bounds
            # only; the others give the comparand back (they never reach memory).
            shape = np.shape(ptrs)
            flat = runs.reshape(-1)
            compare = np.broadcast_to(np.asarray(cmp), shape).reshape(-1)
            out = compare.copy()
            if flat.any():
                out[flat] = np.asarray(self._native.atomic_cas(
                    np.asarray(ptrs).reshape(-1)[flat], compare[flat],
                    np.broadcast_to(np.asarray(value), shape).reshape(-1)[flat], sem))
            out = out.reshape(shape)
        if self.concurrent is not None:
            self.concurrent.atomic(ptrs, runs, itemsize, _sem_name(sem), wrote=True)
        return out


def _sem_name(sem: Any) -> str:
    """``MEM_SEMANTIC.ACQUIRE_RELEASE`` -> ``ACQUIRE_RELEASE`` (the interpreter's enum or
    the IR's)."""
    return str(getattr(sem, "name", sem)).rsplit(".", 1)[-1].upper()


class Concurrent:
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
        views = sorted(((s.data_ptr(), bytes_view(s)) for s in storages if s.nbytes()),
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


def bytes_view(storage: Any) -> np.ndarray:
    """The bytes of a CPU storage as a numpy array sharing its memory."""
    return torch.empty(0, dtype=torch.uint8).set_(storage).numpy()


def install_bounds_checks() -> Bounds:
    """Route the interpreter's memory accesses through a :class:`Bounds` (this process),
    and count each launch's FLOPs on it (:func:`_count_flops`)."""
    from triton.runtime import interpreter

    if not isinstance(interpreter._interpreter, Bounds):
        interpreter._interpreter = Bounds(interpreter._interpreter)
        _count_flops(interpreter._interpreter)
        _order_programs(interpreter._interpreter)
    return interpreter._interpreter


def _order_programs(bounds: Bounds) -> None:
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


def _count_flops(bounds: Bounds) -> None:
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
