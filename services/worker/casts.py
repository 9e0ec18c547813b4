"""Value-changing casts in a launch plan (rule D029): compute outside the kernels.

The replayer runs a plan's allowlisted copies (:data:`services.worker.rules.COPY_OPS`)
as data movement, and most are: a layout copy, a widening cast (float16 to float32).
A cast that changes values is not: float to int truncates (``x.to(torch.int32)
.to(torch.float32)`` is ``trunc``), a narrowing float cast rounds (float32 to float16,
bfloat16 or float8), complex to real drops a part. Such a cast counts as compute,
failing the plan as an operator off the allowlist does (kind ``compute``, stage
``audit``), unless it is the task's own final step: its result lies in a storage the
call returns (an output, whose dtype the comparison requires to be the reference's, so
the task's reference makes that dtype too) and no later event of the plan (a launch, a
copy, anything but a view) uses that storage.

Not counted: casts from integer or bool sources (indices narrowed to int32 for a kernel,
positions made float), casts to a dtype holding every value of the source.
"""

from __future__ import annotations

from typing import Any

import torch

from services.sandbox import values
from services.worker.rules import COPY_OPS, VIEW_OPS, op_packet

_COMPLEX_PARTS = {torch.complex32: torch.float16, torch.complex64: torch.float32,
                  torch.complex128: torch.float64}


def changes_values(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether a cast from floating or complex ``src`` to ``dst`` can change a value:
    to an integer or bool dtype, from complex to real, or to a float with a larger
    epsilon, a smaller largest value or a larger smallest normal (``torch.finfo``).
    Integer and bool sources: False (see the module doc)."""
    if src == dst or not (src.is_floating_point or src.is_complex):
        return False
    if not (dst.is_floating_point or dst.is_complex):
        return True
    if src.is_complex and not dst.is_complex:
        return True
    fs = torch.finfo(_COMPLEX_PARTS.get(src, src))
    fd = torch.finfo(_COMPLEX_PARTS.get(dst, dst))
    return fd.eps > fs.eps or fd.max < fs.max or fd.tiny > fs.tiny


def _refs(tree: Any) -> list[dict[str, Any]]:
    """The encoded tensor references in ``tree`` (an event's args, kwargs or outputs)."""
    if isinstance(tree, dict):
        if tree.get(values.TAG) == "T":
            return [tree]
        return [r for v in tree.values() for r in _refs(v)]
    if isinstance(tree, list):
        return [r for v in tree for r in _refs(v)]
    return []


def _dtype(ref: dict[str, Any]) -> torch.dtype | None:
    try:
        return values.dtype_from_name(ref.get("d"))
    except ValueError:
        return None


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(a.get(k) == b.get(k) for k in ("s", "o", "z", "r", "d"))


def _used_later(events: list[Any], storage: Any) -> str | None:
    """The first later event (a launch, or an operator other than a view) given a
    tensor of ``storage``: its name, or None."""
    for event in events:
        if not isinstance(event, dict):
            continue
        if "launch" in event:
            if any(r.get("s") == storage for r in _refs(event.get("args"))):
                return f"kernel {event['launch']}"
        elif "op" in event and op_packet(str(event["op"])) not in VIEW_OPS:
            if any(r.get("s") == storage for r in _refs([event.get("args"),
                                                         event.get("kwargs")])):
                return str(event["op"])
    return None


def value_changing_cast(events: list[Any], outputs: Any) -> str | None:
    """The first value-changing cast of the plan ``events`` that is not the task's own
    final step on an output (module doc), as a message naming the operator, the dtypes
    and why; None when there is none.

    ``events``: the recorded plan (:mod:`services.worker.trace`'s encoded events);
    ``outputs``: the call's recorded output tree.
    """
    returned = {r.get("s") for r in _refs(outputs)}
    for i, event in enumerate(events):
        if not isinstance(event, dict) or "op" not in event:
            continue
        name = str(event["op"])
        packet = op_packet(name)
        if packet not in COPY_OPS:
            continue
        made = _refs(event.get("out"))
        given = _refs(event.get("args"))
        if packet in ("_copy_from", "_copy_from_and_resize") and len(given) >= 2:
            src, dst = given[0], given[1]
        elif made:
            dst = made[0]
            sources = [r for r in given if not _same(r, dst)]
            if not sources:
                continue
            src = sources[0]
        else:
            continue
        src_dtype, dst_dtype = _dtype(src), _dtype(dst)
        if src_dtype is None or dst_dtype is None or not changes_values(src_dtype, dst_dtype):
            continue
        cast = (f"{name} casts {values.dtype_name(src_dtype)} to "
                f"{values.dtype_name(dst_dtype)}")
        if dst.get("s") not in returned:
            return (f"{cast} in ModelNew.forward, which changes values (a truncation or "
                    "a rounding: compute), and its result is not an output; do the "
                    "conversion in a Triton kernel (a cast is data movement only as the "
                    "last step on an output of the task's dtype)")
        later = _used_later(events[i + 1:], dst.get("s"))
        if later is not None:
            return (f"{cast} in ModelNew.forward, which changes values (a truncation or "
                    f"a rounding: compute), and {later} then uses its result; do the "
                    "conversion in a Triton kernel (a cast is data movement only as the "
                    "last step on an output of the task's dtype)")
    return None
