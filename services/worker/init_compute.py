"""Values torch computed before ``forward``: what the candidate's import and
``ModelNew.__init__`` made with compute operators (rule D030).

The planner's trace captures every storage ``forward`` uses that it did not create
(parameters, buffers, module constants) and the replayer gets those bytes as the
planner first saw them. A table torch computed from constants in ``__init__``
(``torch.exp(torch.linspace(...))``, a precomputed answer) would then reach the
outputs through a kernel that only gathers from it: torch, not the kernels, computed
the values. So the planner records, from before the candidate's import until the
first call, where each storage's bytes came from (:class:`InitRecorder`, a
``TorchDispatchMode``):

* *clean*: allocations and fills with constants (``empty``, ``zeros``, ``full``,
  ``arange`` ...; :data:`services.worker.rules.ALLOCATION_OPS`), the init seed's random
  fills (``uniform_``, ``normal_``, ``randn`` ...: how ``nn.Linear`` and
  ``nn.init`` make weights; :data:`RANDOM_OPS`), the constructor's tensor arguments,
  and copies of clean storages (views, layout and dtype copies, ``cat``, padding:
  :data:`INIT_COPY_OPS`);
* *computed*: the output of any other ATen operator, a storage such an operator wrote
  in place, and copies of those; a tensor made from host values (``torch.tensor``,
  ``torch.from_numpy``: Python or numpy computed them); a storage no recorded operator
  made; once a value of the init's tensors, computed or init-seeded, was read into
  Python (``.item()``), fills and allocations that take a Python number (it may carry
  that value); and a storage joined from constant pieces of more than one value
  (:data:`JOINED`): ``torch.cat`` / ``torch.stack`` of ``torch.full`` pieces, fills
  written into parts of one buffer, constant padding of a fill, random fills too
  narrow to be random (``uniform_(v, v)``): each piece is a constant, together they are
  a table Python computed. One fill value throughout (a ``torch.ones`` scale, zeros)
  stays clean, as does a fill joined to init-seeded weights (zero padding).

A captured storage that is computed is exempt when its values equal a tensor of the
task's own ``Model`` built under the same init seed (:func:`value_digests`; the
reference child sends :func:`state_digests`): a mask or table the task builds too is
the task's. Otherwise the verdict names it, and the worker replays the first call with
its bytes perturbed (:func:`perturb`, a secret seed): outputs that change beyond the
tolerance depend on values torch computed, and the verification fails at ``audit``.

The recorder lives in the candidate's process; what it cannot see (an operator run
under torch's dispatch-disabling internals, refused statically by S023) makes a
storage it never saw, which counts as computed. Raises nothing of its own.
"""

from __future__ import annotations

import hashlib
import numbers
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from services.worker.rules import ALLOCATION_OPS, ALLOWED_OPS, op_packet

# Random fills under the init seed: how torch.nn's layers and torch.nn.init make
# weights (kaiming_uniform_ and xavier_* are uniform_, trunc_normal_ is normal_ and a
# clamp, ...). Their values are the seed's, no computed table.
RANDOM_OPS = frozenset({
    "normal_", "uniform_", "bernoulli_", "random_", "exponential_", "geometric_",
    "log_normal_", "cauchy_", "randn", "rand", "randint", "randperm", "normal", "bernoulli",
    "rand_like", "randn_like", "randint_like", "multinomial", "poisson",
})
# Data movement in __init__ beyond the forward allowlist: the same values placed
# elsewhere (fused weights by cat/stack, padded to a block multiple, flipped, tiled).
INIT_COPY_OPS = frozenset({
    "cat", "stack", "constant_pad_nd", "flip", "roll", "repeat", "expand_copy",
    "permute_copy", "t_copy", "transpose_copy", "view_copy", "unsqueeze_copy",
    "squeeze_copy", "slice_copy", "select_copy", "index_select",
})
NOT_COMPUTE = ALLOWED_OPS | RANDOM_OPS | INIT_COPY_OPS
# Operators whose written values come from a Python number argument.
_SCALAR_VALUE_OPS = (ALLOCATION_OPS | RANDOM_OPS) - {"empty", "empty_like", "empty_strided",
                                                     "empty_permuted", "new_empty",
                                                     "new_empty_strided"}

# How named_tensors prefixes a tensor the candidate's module holds at top level.
MODULE_PREFIX = "module:"
HOST = "torch.tensor/from_numpy of host values"
OUTSIDE = "no recorded operator (made outside torch's operators)"
ITEM = ".item() of computed values"
ITEM_SEEDED = ".item() of the init's tensors"
JOINED = "constant pieces of different values joined (cat/stack/part writes of fills)"
# A piece's constant value, by operator: where the value is (an argument's name) or
# what it is. Random fills whose spread is below _NARROW of their magnitude are
# constants in disguise (uniform_(v, v), normal_(v, 0), randint(v, v + 1)).
_FILL_ARGUMENT = {"full": "fill_value", "full_like": "fill_value", "new_full": "fill_value",
                  "fill_": "value", "scalar_tensor": "s", "constant_pad_nd": "value"}
_FILL_CONSTANT = {"ones": 1.0, "ones_like": 1.0, "new_ones": 1.0, "zeros": 0.0,
                  "zeros_like": 0.0, "new_zeros": 0.0, "zero_": 0.0}
_NARROW = 0.1
# Operators whose output replaces what the storage held when they write all of it.
_OVERWRITES = frozenset({"fill_", "zero_"}) | RANDOM_OPS


@dataclass
class Origin:
    """Where one storage's bytes came from: ``labels`` (empty: clean), the storage
    (kept so that its address is not reused), the first tensor's dtype and shape."""

    storage: Any
    labels: set[str] = field(default_factory=set)
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] = ()
    # The constant pieces its bytes came from (their values), and whether any part is
    # init-seeded random or a constructor argument.
    pieces: set[str] = field(default_factory=set)
    seeded: bool = False


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return None


def _narrow(center: float | None, spread: float | None) -> bool:
    """Whether a random fill of this center and spread is a constant in disguise."""
    if center is None or spread is None:
        return False
    return abs(spread) <= _NARROW * abs(center) or spread == 0


def _bound(func: Any, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``func``'s arguments by their schema names (defaults filled in)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return {}
    out: dict[str, Any] = {}
    for i, argument in enumerate(schema.arguments):
        if i < len(args):
            out[argument.name] = args[i]
        elif argument.name in kwargs:
            out[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            out[argument.name] = argument.default_value
    return out


def piece(packet: str, bound: dict[str, Any]) -> tuple[str | None, bool]:
    """The constant one operator writes (its value as text, or None) and whether it
    writes init-seeded random values instead: ``full(.., 2.5)`` -> ``("2.5", False)``,
    ``uniform_(-b, b)`` -> ``(None, True)``, ``uniform_(2.5, 2.5)`` -> ``("2.5",
    False)``, ``arange(0, n)`` -> ``("arange from 0.0 step 1.0", False)``."""
    if packet in _FILL_CONSTANT:
        return repr(_FILL_CONSTANT[packet]), False
    if packet in _FILL_ARGUMENT:
        value = _number(bound.get(_FILL_ARGUMENT[packet], 0 if packet == "constant_pad_nd"
                                  else None))
        return (repr(value) if value is not None else None), False
    if packet == "arange":
        start = _number(bound.get("start", 0)) if "end" in bound else 0.0
        step = _number(bound.get("step", 1))
        return f"arange from {start!r} step {step!r}", False
    if packet not in RANDOM_OPS:
        return None, False
    low = high = None
    if packet == "uniform_":
        low, high = _number(bound.get("from")), _number(bound.get("to"))
    elif packet in ("randint", "random_"):
        low, high = _number(bound.get("low", bound.get("from", 0))), \
            _number(bound.get("high", bound.get("to")))
        if low is None and packet == "random_":
            low = 0.0
        if low is not None and high is not None and high - low <= 1:
            return repr(low), False
        return None, True
    elif packet in ("normal_", "normal", "log_normal_", "cauchy_"):
        center = _number(bound.get("mean", bound.get("median")))
        spread = _number(bound.get("std", bound.get("sigma")))
        if packet == "log_normal_" and spread is not None and center is not None:
            return (f"exp {center!r}" if spread <= _NARROW else None), spread > _NARROW
        return (repr(center), False) if _narrow(center, spread) else (None, True)
    elif packet in ("bernoulli_", "bernoulli", "geometric_"):
        p = _number(bound.get("p"))
        if p is not None and (p <= 0 or p >= 1):
            return repr(1.0 if p >= 1 else 0.0), False
        return None, True
    if low is not None and high is not None and _narrow((low + high) / 2, high - low):
        return repr((low + high) / 2), False
    return None, True


def _covers(t: Any) -> bool:
    """Whether tensor ``t`` spans all of its storage's bytes."""
    try:
        return t.is_contiguous() and t.storage_offset() == 0 and \
            t.numel() * t.element_size() == t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return False


def _key(t: torch.Tensor) -> int | None:
    if not isinstance(t, torch.Tensor) or t.is_meta or t.layout != torch.strided:
        return None
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):
        return None


class InitRecorder(TorchDispatchMode):
    """The origin of every storage the candidate's import and constructors make (see
    the module's docstring). Enter it around the import and each real build;
    :meth:`register_clean` the constructor's tensor arguments first."""

    def __init__(self) -> None:
        super().__init__()
        self.origins: dict[int, Origin] = {}
        self.taint: set[str] = set()
        self._since_retire = 0

    def register_clean(self, tensors: list[Any]) -> None:
        """Tensors the harness made (the constructor's arguments): clean."""
        for t in tensors:
            key = _key(t)
            if key is not None and key not in self.origins:
                self.origins[key] = Origin(t.untyped_storage(), set(), t.dtype, tuple(t.shape),
                                           seeded=True)

    def labels_of(self, t: torch.Tensor) -> set[str]:
        key = _key(t)
        if key is None:
            # A meta tensor holds no values; any other tensor whose storage cannot be
            # told (another layout) is of unknown origin, not clean.
            return set() if isinstance(t, torch.Tensor) and t.is_meta else {OUTSIDE}
        origin = self.origins.get(key)
        return {OUTSIDE} if origin is None else set(origin.labels)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        try:
            self._note(func, args, kwargs, out)
        except Exception:  # noqa: BLE001 - never change what the candidate's code does
            pass
        return out

    def _pieces(self, given: list[torch.Tensor]) -> tuple[set[str], bool]:
        pieces: set[str] = set()
        seeded = False
        for t in given:
            origin = self.origins.get(_key(t)) if _key(t) is not None else None
            if origin is not None:
                pieces |= origin.pieces
                seeded = seeded or origin.seeded
        return pieces, seeded

    def _note(self, func: Any, args: tuple, kwargs: dict[str, Any], out: Any) -> None:
        packet = op_packet(str(func))
        given = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        labels: set[str] = set()
        pieces, seeded = self._pieces(given)
        own, random = piece(packet, _bound(func, args, kwargs))
        if own is not None:
            pieces.add(own)
        seeded = seeded or random
        if packet in ("lift_fresh", "lift_fresh_copy"):
            labels = {HOST} if any(_key(t) not in self.origins for t in given) else set()
            for t in given:
                labels |= self.labels_of(t) - {OUTSIDE}
        else:
            for t in given:
                labels |= self.labels_of(t)
        if packet == "_local_scalar_dense":
            if labels:
                self.taint |= labels | {ITEM}
            elif seeded:
                self.taint.add(ITEM_SEEDED)
            return
        if len(pieces) > 8:
            pieces = set(sorted(pieces)[:8])
        if packet not in NOT_COMPUTE:
            labels.add(f"aten.{packet}")
        if self.taint and packet in _SCALAR_VALUE_OPS and any(
                isinstance(v, numbers.Number) and not isinstance(v, bool)
                for v in tree_leaves((args, kwargs))):
            labels |= self.taint
        schema = getattr(func, "_schema", None)
        if schema is not None:
            for i, argument in enumerate(schema.arguments):
                alias = argument.alias_info
                if alias is None or not alias.is_write:
                    continue
                value = kwargs.get(argument.name, args[i] if i < len(args) else None)
                for t in tree_leaves(value):
                    if packet == "copy_" and _covers(t):
                        # a copy over all of it: the source's pieces replace its own
                        src = self._pieces([g for g in given if g is not t])
                        self._write(t, labels, *src, True)
                        continue
                    whole = packet in _OVERWRITES and _covers(t)
                    self._write(t, labels, ({own} if own else set()) if whole else pieces,
                                random if whole else seeded, whole)
        for t in tree_leaves(out):
            key = _key(t)
            if key is not None and key not in self.origins:
                self.origins[key] = Origin(t.untyped_storage(),
                                           labels | ({JOINED} if len(pieces) > 1 else set()),
                                           t.dtype, tuple(t.shape), set(pieces), seeded)
                self._since_retire += 1
        if self._since_retire > 4096:
            self.retire_dead()

    def _write(self, t: Any, labels: set[str], pieces: set[str], seeded: bool,
               whole: bool) -> None:
        """An operator wrote ``t`` in place: its storage takes the operator's labels and
        pieces (replacing the pieces when a fill or random fill wrote all of it)."""
        key = _key(t)
        if key is None:
            return
        origin = self.origins.get(key)
        if origin is None:
            self.origins[key] = Origin(t.untyped_storage(), labels | {OUTSIDE}, t.dtype,
                                       tuple(t.shape), set(pieces), seeded)
            return
        origin.labels |= labels
        if whole:
            origin.pieces, origin.seeded = set(pieces), seeded
        else:
            origin.pieces |= pieces
            origin.seeded = origin.seeded or seeded
        if len(origin.pieces) > 1:
            origin.labels.add(JOINED)
        if len(origin.pieces) > 8:
            origin.pieces = set(sorted(origin.pieces)[:8])

    def retire_dead(self) -> None:
        """Forget storages only this recorder still holds."""
        use_count = torch._C._storage_Use_Count
        for key in [k for k, o in self.origins.items() if use_count(o.storage._cdata) <= 1]:
            del self.origins[key]
        self._since_retire = 0

    def computed(self, storage: Any, names: dict[int, tuple[str, torch.Tensor]]
                 ) -> dict[str, Any] | None:
        """What :func:`suspects` reports of one captured ``storage``; None when clean."""
        key = int(storage._cdata)
        origin = self.origins.get(key)
        labels = {OUTSIDE} if origin is None else origin.labels
        if not labels:
            return None
        name, tensor = names.get(key, (None, None))
        if tensor is None and origin is not None and origin.dtype is not None:
            itemsize = torch.empty(0, dtype=origin.dtype).element_size()
            if storage.nbytes() % itemsize == 0:
                tensor = torch.empty(0, dtype=origin.dtype, device=storage.device).set_(
                    storage, 0, (storage.nbytes() // itemsize,))
        return {"name": name, "ops": sorted(labels),
                "dtype": str(tensor.dtype).removeprefix("torch.") if tensor is not None
                else "uint8",
                "shape": list(tensor.shape) if tensor is not None else [storage.nbytes()],
                "digests": sorted(value_digests(tensor, casts=False)) if tensor is not None
                else []}


def named_tensors(roots: list[tuple[str, Any]]) -> dict[int, tuple[str, torch.Tensor]]:
    """Storage key -> (a name, the tensor) of every parameter, buffer and tensor
    attribute reachable from ``roots`` (``(prefix, module or namespace)``), first
    name kept: how a verdict names a storage."""
    found: dict[int, tuple[str, torch.Tensor]] = {}

    def add(name: str, t: Any) -> None:
        key = _key(t)
        if key is not None and key not in found:
            found[key] = (name, t)

    for prefix, root in roots:
        if isinstance(root, torch.nn.Module):
            for name, t in root.named_parameters(remove_duplicate=False):
                add(prefix + name, t)
            for name, t in root.named_buffers(remove_duplicate=False):
                add(prefix + name, t)
            for mod_name, module in root.named_modules(remove_duplicate=False):
                for name, t in vars(module).items():
                    if isinstance(t, torch.Tensor):
                        add(prefix + (f"{mod_name}." if mod_name else "") + name, t)
        elif isinstance(root, dict):
            for name, t in root.items():
                if isinstance(t, torch.Tensor) and not name.startswith("__"):
                    add(prefix + name, t)
    return found


def value_digests(t: torch.Tensor, *, casts: bool = True) -> set[str]:
    """sha256 digests of ``t``'s values, row-major, as float64 (so a bool or float
    mask, a view with other strides or extents of size 1 give the same digest); with
    ``casts`` also of its transpose (2-D) and of its values rounded to float16 and
    bfloat16 (a weight kept in half precision)."""
    t = t.detach().to("cpu")
    forms = [t]
    if casts:
        if t.dim() == 2:
            forms.append(t.t())
        if t.is_floating_point():
            forms += [f.to(dt) for f in list(forms) for dt in (torch.float16, torch.bfloat16)]
    found = set()
    for f in forms:
        h = hashlib.sha256(f"{f.numel()}".encode())
        if f.is_complex():
            f = torch.view_as_real(f.resolve_conj())
        values = f.contiguous().reshape(-1).to(torch.float64)
        h.update(memoryview(values.numpy()).cast("B"))
        found.add(h.hexdigest())
    return found


def state_digests(model: Any) -> list[str]:
    """Digests (:func:`value_digests`, with casts) of every parameter, buffer and tensor
    attribute of the task's ``Model``: what a candidate may hold computed (the task's
    own masks and tables)."""
    found: set[str] = set()
    for _, t in named_tensors([("", model)]).values():
        if t.numel() <= (1 << 24):
            found |= value_digests(t)
    return sorted(found)


def perturb(data: bytes | bytearray, dtype_name: str, seed: int) -> bytes:
    """``data`` (one storage's bytes, elements of ``dtype_name``) perturbed from
    ``seed``: its elements permuted and, for floating point, each scaled by a factor
    within 1 +- 1/32, so that outputs that depend on the values change (zeros stay
    zeros, integer and bool tables keep their values, permuted). Other dtypes, or a size
    that is no multiple of the element's, are permuted as bytes."""
    rng = np.random.default_rng(seed)
    widths = {"float16": np.float16, "float32": np.float32, "float64": np.float64,
              "bfloat16": np.uint16, "int8": np.int8, "int16": np.int16, "int32": np.int32,
              "int64": np.int64, "uint8": np.uint8, "bool": np.uint8}
    kind = widths.get(dtype_name, np.uint8)
    if len(data) % np.dtype(kind).itemsize:
        kind = np.uint8
    values = np.frombuffer(bytes(data), dtype=kind).copy()
    values = values[rng.permutation(values.size)]
    if dtype_name in ("float16", "float32", "float64"):
        scale = 1.0 + rng.uniform(-1 / 32, 1 / 32, values.size)
        values = (values.astype(np.float64) * scale).astype(kind)
    elif dtype_name == "bfloat16":
        as32 = (values.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        as32 = (as32 * (1.0 + rng.uniform(-1 / 32, 1 / 32, values.size))).astype(np.float32)
        values = (as32.view(np.uint32) >> 16).astype(np.uint16)
    return values.tobytes()
