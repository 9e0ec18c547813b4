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
  from the seed, and concurrently (:class:`Concurrent`); when what it leaves in memory
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

This module runs the plan (:class:`Replayer`); how the interpreter's memory is checked
and ordered (the bounds checks, the concurrent model, the programs' order, FLOP
counts) is :mod:`services.worker.replay_memory`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from services.sandbox import values
from services.sandbox.values import TensorRef
from services.worker.replay_memory import (
    Bounds,
    Concurrent,
    ReplayError,
    bytes_view,
    install_bounds_checks,
)
from services.worker.rules import ALLOWED_OPS, op_packet
from services.worker.trace import UNDEFINED_ALLOCATIONS, Fill, code_end_line, fill_undefined
from services.worker.traffic import LaunchTraffic, op_traffic

# The replayer child (services/worker/_replayer.py) takes everything of a replay from
# here: the error and the interpreter's checks are replay_memory's.
__all__ = ["ReplayError", "Replayer", "Variant", "install_bounds_checks", "resolve_ops"]


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
                 bounds: Bounds | None = None, ops: dict[str, Any] | None = None) -> None:
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
        code = getattr(getattr(fn, "fn", None), "__code__", None)
        with self._checked(name, args, launch, getattr(code, "co_filename", "")):
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
        views = [bytes_view(storage) for storage, _, _ in items]
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
                bounds.concurrent = Concurrent([s for s, _, _ in items]) if concurrent \
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
    def _checked(self, name: str, args: dict[str, Any], launch: LaunchTraffic | None = None,
                 source: str = "") -> Iterator[None]:
        """The launch of kernel ``name`` on ``args`` (loaded from the file ``source``)
        bounds-checked on the interpreter and counted into ``launch``.

        Raises:
            ReplayError: (bounds) the launch accessed memory outside its arguments: every
                such lane of the launch counted, by argument and kernel line
                (:meth:`~services.worker.replay_memory.Bounds.fault_error`), also when
                the kernel then failed (what it read there was not memory).
        """
        bounds = self.bounds
        if bounds is None:
            yield
            return
        ranges, origins = [], {}
        for arg, value in args.items():
            for t in values.flat_tensors(value):
                storage = t.untyped_storage()
                if storage.nbytes():
                    ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes(),
                                   arg))
                    origins.setdefault(arg, t.data_ptr())
        bounds.set_ranges(ranges, name, origins=origins, source=source)
        bounds.count = launch
        try:
            try:
                yield
            except ReplayError as exc:
                if exc.kind == "bounds" or not bounds.faults:
                    raise
                raise bounds.fault_error() from None
            fault = bounds.fault_error()
            if fault is not None:
                raise fault
        finally:
            bounds.set_ranges([], "")
            bounds.count = None


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
