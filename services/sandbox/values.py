"""Python values as msgpack-able trees: task inputs, constructor arguments, traced op and
kernel arguments.

A *value tree* is what ``get_inputs()`` / ``get_init_inputs()`` return and what a traced
ATen op or Triton launch takes: tensors, numbers, strings, None, dtypes, devices,
tuples and lists of those. :func:`encode` turns one into plain msgpack types, tensors
becoming a :class:`TensorRef` (``{"~": "T", ...}``) that names a *storage* by an
integer; the bytes travel apart (raw frames, or a storage table), so a tree never
holds data. :func:`decode` rebuilds the tree from the refs with a function that
returns the tensor for each ref.

Used by both sides of every sandboxed child's channel
(:mod:`services.sandbox.wire`), so it imports nothing from the harness.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import msgspec
import torch

# The reserved key of a tagged node. A dict without it is a plain mapping (kwargs).
TAG = "~"


class ValueError_(ValueError):
    """A value that has no encoding (an object the trace cannot carry)."""


class TensorRef(msgspec.Struct, frozen=True):
    """A strided view of a storage: ``storage`` (an id the sender chose), element
    ``offset``, ``shape``, ``stride`` (elements) and ``dtype`` (``float32``)."""

    storage: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=dtype_from_name(self.dtype)).element_size()

    def span_bytes(self) -> tuple[int, int]:
        """(first byte, one past the last byte) this view touches in its storage; (0, 0)
        when it holds no element."""
        if self.numel == 0:
            return 0, 0
        size = self.itemsize
        low = high = self.offset
        for extent, step in zip(self.shape, self.stride, strict=True):
            if step >= 0:
                high += (extent - 1) * step
            else:
                low += (extent - 1) * step
        return low * size, (high + 1) * size


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`.

    Raises:
        ValueError: ``name`` is not a torch dtype (names come from untrusted children).
    """
    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


_MEMORY_FORMATS = {str(f).removeprefix("torch."): f for f in (
    torch.contiguous_format, torch.channels_last, torch.channels_last_3d,
    torch.preserve_format)}
_LAYOUTS = {str(f).removeprefix("torch."): f for f in (torch.strided, torch.sparse_coo)}


def triton_dtype_name(value: Any) -> str | None:
    """The name of a ``triton.language`` dtype (``fp16``), or None for anything else."""
    cls = type(value)
    if cls.__module__.startswith("triton.language") and cls.__name__ in (
            "dtype", "pointer_type", "block_type") and hasattr(value, "name"):
        return str(value.name)
    return None


def encode(value: Any, tensor: Callable[[torch.Tensor], TensorRef]) -> Any:
    """``value`` as msgpack types; each tensor becomes ``tensor(t)``'s ref.

    Raises:
        ValueError_: a value of another type (a generator, a module, a function).
    """
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, torch.Tensor):
        ref = tensor(value)
        return {TAG: "T", "s": ref.storage, "o": ref.offset, "z": list(ref.shape),
                "r": list(ref.stride), "d": ref.dtype}
    if isinstance(value, complex):
        return {TAG: "c", "v": [value.real, value.imag]}
    if isinstance(value, torch.dtype):
        return {TAG: "dtype", "v": dtype_name(value)}
    if isinstance(value, torch.device):
        return {TAG: "device", "v": str(value)}
    if isinstance(value, torch.memory_format):
        return {TAG: "mf", "v": str(value).removeprefix("torch.")}
    if isinstance(value, torch.layout):
        return {TAG: "layout", "v": str(value).removeprefix("torch.")}
    if isinstance(value, torch.Size):
        return {TAG: "tuple", "v": [int(v) for v in value]}
    if isinstance(value, tuple):
        return {TAG: "tuple", "v": [encode(v, tensor) for v in value]}
    if isinstance(value, list):
        return [encode(v, tensor) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) and k != TAG for k in value):
        return {k: encode(v, tensor) for k, v in value.items()}
    name = triton_dtype_name(value)
    if name is not None:
        return {TAG: "tl", "v": name}
    inner = getattr(value, "value", None) if type(value).__name__ == "constexpr" else None
    if inner is not None or type(value).__name__ == "constexpr":
        return encode(inner, tensor)
    raise ValueError_(f"a value of type {type(value).__name__} cannot be carried "
                      "(tensors, numbers, strings, None, dtypes, tuples and lists can)")


def decode(tree: Any, tensor: Callable[[TensorRef], torch.Tensor],
           device: torch.device | None = None) -> Any:
    """Rebuild a value encoded by :func:`encode`; each ref becomes ``tensor(ref)``.

    ``device``: devices in the tree are replaced by it (a trace recorded on one device
    replayed on another); None keeps them.

    Raises:
        ValueError_: a malformed tree (it comes from an untrusted child).
    """
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    if isinstance(tree, list):
        return [decode(v, tensor, device) for v in tree]
    if not isinstance(tree, dict):
        raise ValueError_(f"malformed value of type {type(tree).__name__}")
    kind = tree.get(TAG)
    if kind is None:
        return {str(k): decode(v, tensor, device) for k, v in tree.items()}
    try:
        if kind == "T":
            ref = TensorRef(storage=int(tree["s"]), offset=int(tree["o"]),
                            shape=tuple(int(v) for v in tree["z"]),
                            stride=tuple(int(v) for v in tree["r"]), dtype=str(tree["d"]))
            if len(ref.shape) != len(ref.stride) or any(v < 0 for v in ref.shape) \
                    or ref.offset < 0:
                raise ValueError_(f"malformed tensor reference {tree}")
            dtype_from_name(ref.dtype)
            return tensor(ref)
        value = tree["v"]
        if kind == "tuple":
            return tuple(decode(v, tensor, device) for v in value)
        if kind == "c":
            return complex(float(value[0]), float(value[1]))
        if kind == "dtype":
            return dtype_from_name(value)
        if kind == "device":
            return device if device is not None else torch.device(str(value))
        if kind == "mf":
            return _MEMORY_FORMATS[value]
        if kind == "layout":
            return _LAYOUTS[value]
        if kind == "tl":
            import triton.language as tl

            found = getattr(tl, _TL_NAMES.get(value, value), None)
            if found is None or triton_dtype_name(found) is None:
                raise ValueError_(f"unknown Triton dtype {value!r}")
            return found
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        if isinstance(exc, ValueError_):
            raise
        raise ValueError_(f"malformed value {tree!r}: {exc}") from None
    raise ValueError_(f"unknown value kind {kind!r}")


# Triton dtype names (dtype.name) -> their triton.language attribute.
_TL_NAMES = {"fp8e4nv": "float8e4nv", "fp8e5": "float8e5", "fp8e4b15": "float8e4b15",
             "fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "fp64": "float64",
             "i1": "int1", "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64",
             "u8": "uint8", "u16": "uint16", "u32": "uint32", "u64": "uint64"}


def flat_leaves(tree: Any, kind: type) -> list:
    """The leaves of type ``kind`` of a value tree of nested lists and tuples, in order."""
    if isinstance(tree, kind):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [leaf for v in tree for leaf in flat_leaves(v, kind)]
    return []


def flat_tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors of a value tree of nested lists and tuples, in order."""
    return flat_leaves(tree, torch.Tensor)


def tensors_in(tree: Any) -> list[dict[str, Any]]:
    """The tensor nodes of an encoded tree, in order."""
    found: list[dict[str, Any]] = []

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for v in node:
                walk(v)
        elif isinstance(node, dict):
            if node.get(TAG) == "T":
                found.append(node)
            elif node.get(TAG) == "tuple":
                for v in node.get("v", []):
                    walk(v)
            elif TAG not in node:
                for v in node.values():
                    walk(v)

    walk(tree)
    return found


def raw_refs(tree: Any) -> list[dict[str, Any]]:
    """The tensor nodes of a tree encoded by :func:`encode_raw` that have bytes (not
    shape-only refs): one raw frame follows for each, in this order."""
    return [node for node in tensors_in(tree) if node.get("s", -1) >= 0]


def contiguous_ref(t: torch.Tensor, storage: int) -> TensorRef:
    """The ref of ``t`` sent as its own contiguous bytes (a raw frame per tensor)."""
    shape = tuple(int(s) for s in t.shape)
    stride = []
    step = 1
    for extent in reversed(shape):
        stride.append(step)
        step *= max(extent, 1)
    return TensorRef(storage=storage, offset=0, shape=shape, stride=tuple(reversed(stride)),
                     dtype=dtype_name(t.dtype))


def encode_raw(tree: Any) -> tuple[Any, list[torch.Tensor]]:
    """``tree`` encoded with each tensor as its own contiguous raw frame: returns the
    encoded tree (refs whose ``storage`` is the tensor's position) and the tensors,
    contiguous, on the CPU, in that order."""
    tensors: list[torch.Tensor] = []

    def ref(t: torch.Tensor) -> TensorRef:
        tensors.append(t.detach().to("cpu").contiguous())
        return contiguous_ref(t, len(tensors) - 1)

    return encode(tree, ref), tensors


def meta_ref(t: torch.Tensor) -> TensorRef:
    """A shape-only ref (storage -1) of ``t``: a meta tensor is made from it."""
    return TensorRef(storage=-1, offset=0, shape=tuple(int(s) for s in t.shape),
                     stride=tuple(int(s) for s in t.stride()), dtype=dtype_name(t.dtype))


def decode_raw(tree: Any, raws: list[Any], device: torch.device | str = "cpu") -> Any:
    """Inverse of :func:`encode_raw`: ``raws[i]`` holds the bytes of ref ``i``; refs with
    storage -1 become meta tensors (see :func:`meta_ref`).

    Raises:
        ValueError_: a ref that does not fit its bytes (both come from another process).
    """
    def tensor(ref: TensorRef) -> torch.Tensor:
        dtype = dtype_from_name(ref.dtype)
        if ref.storage == -1:
            return torch.empty_strided(ref.shape, ref.stride, dtype=dtype, device="meta")
        if not 0 <= ref.storage < len(raws):
            raise ValueError_(f"tensor {ref.storage} has no bytes")
        data = raws[ref.storage]
        itemsize = torch.empty((), dtype=dtype).element_size()
        if len(data) != ref.numel * itemsize:
            raise ValueError_(f"a tensor of shape {list(ref.shape)} and dtype {ref.dtype} "
                              f"cannot hold {len(data)} bytes")
        if ref.numel == 0:
            return torch.empty(ref.shape, dtype=dtype, device=device)
        out = torch.frombuffer(data, dtype=dtype).reshape(ref.shape)
        return out.to(device) if str(device) != "cpu" else out

    return decode(tree, tensor)
