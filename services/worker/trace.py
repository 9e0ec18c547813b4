"""The launch plan of a candidate's ``forward``: what the planner child records, what
the replayer child executes.

The candidate's own process (the *planner*) never sees the real inputs of a trial: it
runs ``forward`` on decoys, with every Triton launch a no-op, while a
:class:`TraceRecorder` (a ``TorchDispatchMode`` plus a hook on Triton's launcher)
writes down every ATen operator and every kernel launch, with each tensor named by
the storage it views (:class:`~services.sandbox.values.TensorRef`). A storage the trace
did not create (a parameter, a constant) is *captured*: its bytes at first sight go
with the trace. The replayer (:mod:`services.worker.replay`) then runs the plan on the
real inputs with only the allowlisted operators and the candidate's own kernels. So
the verdict never rests on anything computed in the candidate's process: whatever
host code computed there saw only decoys, and whatever the trace leaves out is not
reproduced.

The recorder lives in the candidate's process and can be fooled or bypassed; that
only changes the plan, which the replayer judges on data the candidate never saw.

Events (msgpack-able dicts, see :func:`services.sandbox.values.encode` for values):

* ``{"op": "aten.view.default", "args": [...], "kwargs": {...}, "out": tree}``
* ``{"launch": kernel name, "line": def line, "grid": [x, y, z], "args": {name:
  value}, "options": {"num_warps": 4, ...}, "autotune": None | {...}}``; an autotuned
  launch records every config's arguments (``variants``), as the heuristics of that
  config computed them, and the names the autotuner resets or restores.
"""

from __future__ import annotations

import collections
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from services.sandbox import values
from services.sandbox.values import TensorRef
from services.worker.rules import op_packet

# Triton launch keyword arguments that are options, not kernel arguments
# (triton/backends/nvidia/compiler.py CUDAOptions and the interpreter's).
LAUNCH_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg",
                            "enable_fp_fusion", "launch_cooperative_grid", "launch_pdl",
                            "debug", "instrumentation_mode", "fpsan_homomorphic_casts",
                            "num_buffers_warp_spec", "num_consumer_groups",
                            "reg_dec_producer", "reg_inc_consumer", "matrix_instr_nonkdim",
                            "waves_per_eu", "kpack", "extern_libs", "sanitize_overflow",
                            "ptx_options", "arch"})
# ATen allocations whose contents are undefined: filled in the planner's ghost run and
# in every replay from a secret seed the worker draws (:class:`Fill`), so that an output
# no kernel wrote cannot equal the reference by chance, nor one kernel tell a
# verification from a GPU by what a fresh allocation holds.
UNDEFINED_ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "new_empty",
                                   "new_empty_strided", "empty_permuted"})

# The kinds of fill (:class:`Fill`). Poison: what no honest output equals by chance
# (quiet NaN with a random sign and payload, signalling-NaN bit patterns, finite values
# near the dtype's largest; integers: the largest, the smallest, values near either).
# Plausible: what a GPU's fresh memory often holds (random finite values of any
# magnitude, zeros, which a driver's new pages are). ``mixed``: each element of its own
# kind.
POISON_FILLS = ("nan", "snan", "large")
PLAUSIBLE_FILLS = ("random", "zero")
FILL_KINDS = POISON_FILLS + PLAUSIBLE_FILLS + ("mixed",)

# Floating dtype -> (exponent bits, mantissa bits) of its IEEE-754 layout.
_FLOAT_LAYOUT = {torch.float16: (5, 10), torch.bfloat16: (8, 7), torch.float32: (8, 23),
                 torch.float64: (11, 52)}
# Bytes per element -> the signed integer dtype of that width (numpy, torch): what a
# fill's bit patterns are written as.
_WIDTH = {1: (np.int8, torch.int8), 2: (np.int16, torch.int16), 4: (np.int32, torch.int32),
          8: (np.int64, torch.int64)}
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass
class Fill:
    """What fresh allocations hold in one run: ``kind`` (one of :data:`FILL_KINDS`) and
    values drawn from ``seed`` (each allocation its own; the worker draws the seed from
    the OS's cryptographic source and keeps it from the candidate's process).

    ``constant_bool``: a bool allocation gets one value throughout (the planner's ghost
    run, whose outputs are compared with the reference's at the decoys: random bits
    there could equal a small boolean output by chance, a constant cannot equal a
    non-constant one)."""

    kind: str
    seed: int
    constant_bool: bool = False
    rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in FILL_KINDS:
            raise ValueError(f"unknown fill kind {self.kind!r}")
        self.rng = np.random.default_rng(self.seed)

    def bits(self, dtype: torch.dtype, n: int) -> np.ndarray:
        """``n`` elements of ``dtype`` as bit patterns (unsigned numpy integers of its
        width): the fill of one allocation."""
        width = torch.empty(0, dtype=dtype).element_size()
        kinds = np.full(n, FILL_KINDS.index(self.kind), dtype=np.int64)
        if self.kind == "mixed":
            kinds = self.rng.integers(0, len(FILL_KINDS) - 1, n)
        out = np.zeros(n, dtype=np.uint64)
        for k, kind in enumerate(FILL_KINDS[:-1]):
            where = kinds == k
            count = int(where.sum())
            if count:
                out[where] = self._kind_bits(kind, dtype, width, count)
        return out.astype(_UNSIGNED[width])

    def _kind_bits(self, kind: str, dtype: torch.dtype, width: int, n: int) -> np.ndarray:
        rng = self.rng
        bits = 8 * width
        if dtype == torch.bool:
            if self.constant_bool:
                return np.full(n, rng.integers(0, 2), dtype=np.uint64)
            value = {"nan": 1, "large": 1, "zero": 0}.get(kind)
            return rng.integers(0, 2, n, dtype=np.uint64) if value is None else \
                np.full(n, value, dtype=np.uint64)
        if kind == "zero":
            return np.zeros(n, dtype=np.uint64)
        layout = _FLOAT_LAYOUT.get(dtype)
        if layout is not None:
            return self._float_bits(kind, dtype, layout, n)
        if dtype.is_floating_point or kind == "random":
            # Other floating formats (float8 ...): random bytes.
            return rng.integers(0, 1 << bits, n, dtype=np.uint64, endpoint=False) \
                if bits < 64 else rng.integers(0, 2**64, n, dtype=np.uint64, endpoint=False)
        signed = dtype.is_signed
        top = (1 << (bits - 1)) - 1 if signed else (1 << bits) - 1
        low = (1 << (bits - 1)) if signed else 0  # bit pattern of the smallest value
        if kind == "nan":
            return np.full(n, top, dtype=np.uint64)
        if kind == "snan":
            return np.full(n, low, dtype=np.uint64)
        # large: within 2**(bits/2) of the largest or the smallest value.
        near = rng.integers(0, 1 << (bits // 2), n, dtype=np.uint64)
        side = rng.integers(0, 2, n).astype(bool)
        return np.where(side, np.uint64(top) - near, np.uint64(low) + near)

    def _float_bits(self, kind: str, dtype: torch.dtype, layout: tuple[int, int],
                    n: int) -> np.ndarray:
        rng = self.rng
        exp_bits, mant_bits = layout
        total = 1 + exp_bits + mant_bits
        sign = rng.integers(0, 2, n, dtype=np.uint64) << np.uint64(total - 1)
        all_ones = np.uint64(((1 << exp_bits) - 1) << mant_bits)
        quiet = 1 << (mant_bits - 1)
        if kind == "nan":
            mant = np.uint64(quiet) | rng.integers(0, quiet, n, dtype=np.uint64)
            return sign | all_ones | mant
        if kind == "snan":
            return sign | all_ones | rng.integers(1, quiet, n, dtype=np.uint64)
        if kind == "large":
            exponent = np.uint64((1 << exp_bits) - 2) - rng.integers(0, 4, n, dtype=np.uint64)
            mant = rng.integers(0, 1 << mant_bits, n, dtype=np.uint64)
            return sign | (exponent << np.uint64(mant_bits)) | mant
        # random: finite values, normal times a power of ten in [1e-3, 1e3].
        values64 = rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3, n)
        if dtype == torch.bfloat16:
            raw = values64.astype(np.float32).view(np.uint32) >> np.uint32(16)
        else:
            raw = values64.astype({torch.float16: np.float16, torch.float32: np.float32,
                                   torch.float64: np.float64}[dtype]).view(
                _UNSIGNED[total // 8])
        return raw.astype(np.uint64)


class TraceError(RuntimeError):
    """The plan cannot be recorded (an argument the trace cannot carry)."""


def fill_undefined(t: torch.Tensor, fill: Fill | None = None) -> None:
    """Fill the storage of a fresh allocation ``t`` (every byte of it, whatever view
    ``t`` is) as ``fill`` says; None: the fixed fill of old senders (NaN, integers
    their largest value, bool True). Complex tensors are filled as their real pairs; a
    meta tensor is left alone (it holds nothing)."""
    if t.is_meta or t.untyped_storage().nbytes() == 0:
        return
    dtype = t.dtype
    if dtype.is_complex:
        dtype = {torch.complex32: torch.float16, torch.complex64: torch.float32,
                 torch.complex128: torch.float64}.get(dtype, torch.float32)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    storage = t.untyped_storage()
    if itemsize not in _WIDTH or storage.nbytes() % itemsize:
        dtype, itemsize = torch.uint8, 1
    n = storage.nbytes() // itemsize

    def typed(as_dtype: torch.dtype) -> torch.Tensor:
        # new_empty: on the tensor's own device (under the planner's CUDA emulation,
        # ``t.device`` names a GPU that is not there).
        return t.new_empty((0,), dtype=as_dtype).set_(storage, 0, (n,))

    with torch.no_grad():
        if fill is None:
            if dtype.is_floating_point:
                typed(dtype).fill_(float("nan"))
            elif dtype == torch.bool:
                typed(torch.uint8).fill_(1)
            else:
                typed(dtype).fill_(torch.iinfo(dtype).max)
            return
        bits = fill.bits(dtype, n).view(_WIDTH[itemsize][0])
        typed(_WIDTH[itemsize][1]).copy_(torch.from_numpy(bits))


@dataclass
class _Storage:
    id: int
    storage: Any  # the UntypedStorage wrapper, kept so its address is not reused


@dataclass
class Capture:
    """A storage the trace did not create, with its bytes at first sight."""

    id: int
    data: bytes


@dataclass
class CallRecord:
    """One ``forward`` call: its input refs, its events, its captures, its outputs."""

    key: str
    index: int
    inputs: Any = None
    events: list[dict[str, Any]] = field(default_factory=list)
    captures: list[Capture] = field(default_factory=list)
    outputs: Any = None


class TraceRecorder(TorchDispatchMode):
    """Records ATen ops (while entered) and kernel launches (while :attr:`active`).

    Args:
        ghost: launches are recorded, never run, and undefined allocations filled
            (:attr:`fill`).
        capture: copy the bytes of storages the trace did not create (off for the
            meta-device dry run, which has no data).

    Attributes:
        refused: ATen overload name -> calls the dispatcher refused (compute).
        call: the call being recorded (None between calls).
    """

    def __init__(self, *, ghost: bool = True, capture: bool = True) -> None:
        super().__init__()
        self.ghost = ghost
        self.capture = capture
        self.refused: collections.Counter[str] = collections.Counter()
        self.call: CallRecord | None = None
        self._storages: dict[int, _Storage] = {}
        self._next_id = 1
        self._paused = 0
        self._variants: list[dict[str, Any]] | None = None
        self.autotune_choice: Callable[[int], int] = lambda n: 0
        # How a ghost run fills fresh allocations (None: the fixed fill); the planner
        # sets it per call from the seed the worker sends (PlanCall.fill_seed).
        self.fill: Fill | None = None

    # ------------------------------------------------------------ storages

    def _key(self, storage: Any) -> int:
        return int(storage._cdata)

    def ref(self, t: torch.Tensor) -> TensorRef:
        """The ref of ``t``, capturing its storage's bytes when first seen.

        Raises:
            TraceError: a sparse, quantized or nested tensor (no strided storage).
        """
        if t.layout != torch.strided or t.is_quantized or t.is_nested:
            raise TraceError(f"a {t.layout} tensor cannot be traced; use dense tensors")
        storage = t.untyped_storage()
        entry = self._storages.get(self._key(storage))
        if entry is None:
            entry = self._new(storage)
            if self.capture and self.call is not None:
                self.call.captures.append(Capture(entry.id, _storage_bytes(storage)))
        return TensorRef(storage=entry.id, offset=int(t.storage_offset()),
                         shape=tuple(int(s) for s in t.shape),
                         stride=tuple(int(s) for s in t.stride()),
                         dtype=values.dtype_name(t.dtype))

    def _new(self, storage: Any) -> _Storage:
        entry = _Storage(self._next_id, storage)
        self._next_id += 1
        self._storages[self._key(storage)] = entry
        return entry

    def storage_of(self, storage_id: int) -> Any:
        """The storage the plan names ``storage_id`` (None when this recorder forgot it)."""
        for entry in self._storages.values():
            if entry.id == storage_id:
                return entry.storage
        return None

    def register_input(self, t: torch.Tensor) -> TensorRef:
        """The ref of an input ``t`` (fresh, delivered by the harness): its storage gets a
        new id and is not captured (the replayer puts the real input there)."""
        if self._key(t.untyped_storage()) not in self._storages:
            self._new(t.untyped_storage())
        return self.ref(t)

    def retire_dead(self) -> None:
        """Forget storages only this recorder still holds (their addresses may be reused)."""
        use_count = torch._C._storage_Use_Count
        for key in [k for k, e in self._storages.items()
                    if use_count(e.storage._cdata) <= 1]:
            del self._storages[key]

    def encode(self, value: Any) -> Any:
        return values.encode(value, self.ref)

    # ------------------------------------------------------------ calls

    def begin(self, key: str, index: int) -> CallRecord:
        self.call = CallRecord(key=key, index=index)
        return self.call

    def end(self) -> CallRecord:
        call, self.call = self.call, None
        self.retire_dead()
        return call

    # ------------------------------------------------------------ ATen ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if self._paused or self.call is None:
            return func(*args, **kwargs)
        name = str(func)
        try:
            encoded = (self.encode(list(args)), self.encode(kwargs))
        except values.ValueError_ as exc:
            raise TraceError(f"{name}: {exc}") from None
        try:
            out = func(*args, **kwargs)
        except RuntimeError as exc:
            if _refused(exc):
                self.refused[name] += 1
            raise
        fresh = [t for t in values.flat_tensors(out) if self._key(t.untyped_storage()) not in self._storages]
        for t in fresh:
            self._new(t.untyped_storage())
        if self.ghost and op_packet(name) in UNDEFINED_ALLOCATIONS:
            for t in fresh:
                fill_undefined(t, self.fill)
        try:
            out_tree = self.encode(out)
        except values.ValueError_ as exc:
            raise TraceError(f"{name}: {exc}") from None
        self.call.events.append({"op": name, "args": encoded[0], "kwargs": encoded[1],
                                 "out": out_tree})
        return out

    # ------------------------------------------------------------ launches

    def launch(self, fn: Any, original: Callable[..., Any], args: tuple, grid: Any,
               warmup: bool, kwargs: dict[str, Any]) -> Any:
        """Record one launch of the jit function ``fn`` (an InterpretedFunction or a
        JITFunction); run it through ``original`` unless this recorder is a ghost.

        Raises:
            TypeError: the arguments do not bind to the kernel's parameters (as Triton's
                own launch would).
            TraceError: an argument the trace cannot carry.
        """
        if warmup or self.call is None and self._variants is None:
            return original(fn, *args, grid=grid, warmup=warmup, **kwargs)
        python_fn = fn.fn
        signature = inspect.signature(python_fn)
        kernel_kwargs = {k: v for k, v in kwargs.items() if k in signature.parameters}
        options = {k: v for k, v in kwargs.items() if k not in signature.parameters}
        unknown = sorted(set(options) - LAUNCH_OPTIONS)
        if unknown:
            raise TypeError(f"{python_fn.__name__}[grid](...) got unexpected keyword "
                            f"argument(s) {', '.join(unknown)}")
        bound = signature.bind(*args, **kernel_kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        grid_value = grid(arguments) if callable(grid) else grid
        try:
            grid_tuple = tuple(int(g) for g in grid_value)
        except TypeError:
            raise TypeError(f"the grid of {python_fn.__name__} must be a tuple of ints, "
                            f"not {grid_value!r}") from None
        if not 1 <= len(grid_tuple) <= 3:
            raise TypeError(f"the grid of {python_fn.__name__} has {len(grid_tuple)} "
                            "dimensions; Triton takes 1 to 3")
        self._paused += 1
        try:
            record = {"launch": python_fn.__name__,
                      "line": code_end_line(python_fn.__code__),
                      "grid": list(grid_tuple),
                      "args": {k: self.encode(v) for k, v in arguments.items()},
                      "options": {k: v for k, v in options.items()
                                  if isinstance(v, (int, float, bool, str)) or v is None},
                      "autotune": None}
        except values.ValueError_ as exc:
            raise TraceError(f"argument of {python_fn.__name__}: {exc}") from None
        finally:
            self._paused -= 1
        if self._variants is not None:
            self._variants.append(record)
            return None
        if self._pending_autotune is not None:
            record["autotune"] = self._pending_autotune
            self._pending_autotune = None
        self.call.events.append(record)
        if self.ghost:
            return None
        self._paused += 1
        try:
            return original(fn, *args, grid=grid_tuple, warmup=warmup, **kwargs)
        finally:
            self._paused -= 1

    _pending_autotune: dict[str, Any] | None = None

    def autotune(self, tuner: Any, original: Callable[..., Any], args: tuple,
                 kwargs: dict[str, Any]) -> Any:
        """An ``@triton.autotune`` launch: every config's launch recorded as a variant
        (no benchmarking), then the chosen one launched through the chain below."""
        if self.call is None:
            return original(tuner, *args, **kwargs)
        tuner.nargs = dict(zip(tuner.arg_names, args, strict=False))
        configs = tuner.prune_configs(kwargs) if len(tuner.configs) > 1 else tuner.configs
        variants: list[dict[str, Any]] = []
        self._variants = variants
        try:
            for config in configs:
                tuner.fn.run(*args, **kwargs, **config.all_kwargs())
        finally:
            self._variants = None
        chosen = self.autotune_choice(len(configs)) % max(len(configs), 1)
        config = configs[chosen]
        hooks = bool(getattr(tuner, "user_defined_pre_hook", False)
                     or getattr(tuner, "user_defined_post_hook", False)
                     or any(c.pre_hook for c in configs))
        self._pending_autotune = {
            "variants": variants, "chosen": chosen,
            "reset_to_zero": list(tuner.reset_to_zero), "restore_value": list(tuner.restore_value),
            "configs": [str(c) for c in configs], "hooks": hooks}
        try:
            if config.pre_hook is not None:
                config.pre_hook({**tuner.nargs, **kwargs, **config.all_kwargs()})
            return tuner.fn.run(*args, **kwargs, **config.all_kwargs())
        finally:
            self._pending_autotune = None
            tuner.nargs = None


def code_end_line(code: Any) -> int:
    """The last source line of a function's code: with its name, what identifies a
    kernel in the candidate and in the kernel module made from it (the first line is
    the first decorator's, which the kernel module rewrites)."""
    return max((line for _, _, line in code.co_lines() if line is not None), default=0)


def _refused(exc: RuntimeError) -> bool:
    return str(exc).startswith(REFUSED_PREFIX)


# The message prefix of an ATen compute operator refused at the dispatcher
# (services.worker.enforce); the recorder counts those.
REFUSED_PREFIX = "aikg: "


def _storage_bytes(storage: Any) -> bytes:
    """The bytes of an untyped storage (copied to the host first when it is not there)."""
    if storage.nbytes() == 0:
        return b""
    if storage.device.type == "meta":
        return b""
    if storage.device.type != "cpu":
        storage = storage.cpu()
    view = torch.empty(0, dtype=torch.uint8).set_(storage)
    return view.numpy().tobytes()


# ---------------------------------------------------------------- Triton hooks


def install_launch_hooks(recorder_of: Callable[[], TraceRecorder | None]) -> None:
    """Route every Triton launch (interpreted and compiled) and every autotuned launch
    through the active recorder (``recorder_of()``; None: launch as usual)."""
    from triton.runtime import autotuner, interpreter, jit

    def hook(cls: type) -> None:
        original = cls.run

        def run(self, *args, grid, warmup, **kwargs):  # noqa: ANN001
            recorder = recorder_of()
            if recorder is None:
                return original(self, *args, grid=grid, warmup=warmup, **kwargs)
            return recorder.launch(self, original, args, grid, warmup, kwargs)

        run.__name__ = "run"
        cls.run = run

    hook(interpreter.InterpretedFunction)
    hook(jit.JITFunction)
    original_tune = autotuner.Autotuner.run

    def tune(self, *args, **kwargs):  # noqa: ANN001
        recorder = recorder_of()
        if recorder is None:
            return original_tune(self, *args, **kwargs)
        return recorder.autotune(self, original_tune, args, kwargs)

    tune.__name__ = "run"
    autotuner.Autotuner.run = tune
