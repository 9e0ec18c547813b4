"""The lowering registry: which schedule lowers each core-ATen operator, and the
function that lowers a node of it, in one table (:data:`SCHEDULES`).

As PyTorch Inductor's ``lowerings`` table maps an ATen operator to its lowering, each
:class:`Schedule` row pairs an operator set of :mod:`services.generator.lowering.ops`
with the function of :mod:`services.generator.lowering.schedules` that lowers it; the
lowerer asks :func:`schedule_of` for every node it walks. Adding an operator to an
existing schedule is adding it to that schedule's set; adding a schedule is adding a
row here. An operator in two rows is refused when this module loads. ``view``,
``split``, ``arange`` and ``copy`` write forward code only (a view, views, a
``torch.arange``, nothing); ``pointwise`` defers the node into the kernels that read
it; the others write kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.fx

from services.generator.lowering.ops import (
    ARANGES,
    CONCATS,
    CONVOLUTIONS,
    COPIES,
    FLIPS,
    FORWARD_VIEWS,
    MATMULS,
    POINTWISE_OPS,
    POOLS,
    RECURRENT,
    REDUCTIONS,
    SCANS,
    SPLITS,
)
from services.generator.lowering.schedules import (
    concat,
    conv,
    flip,
    matmul,
    pointwise,
    pooling,
    recurrent,
    reduction,
    scan,
    views,
)

if TYPE_CHECKING:
    from services.generator.lowering.lowerer import Lowerer


@dataclass(frozen=True)
class Schedule:
    """One schedule of the built-in coder.

    Attributes:
        name: What it is called in messages and tests, e.g. ``"row reduction"``.
        ops: The core-ATen operators it lowers (``"aten.sum.dim_IntList"``, ...).
        lower: ``lower(lowerer, node, op)``: lowers one graph node of one of ``ops``
            (a kernel and its launch, lines of forward, or a deferred value).
    """

    name: str
    ops: frozenset[str]
    lower: Callable[[Lowerer, torch.fx.Node, str], None]


SCHEDULES: tuple[Schedule, ...] = (
    Schedule("pointwise", POINTWISE_OPS, pointwise.defer),
    Schedule("view", FORWARD_VIEWS, views.view),
    Schedule("arange", ARANGES, views.arange),
    Schedule("row reduction", REDUCTIONS, reduction.lower),
    Schedule("matmul", MATMULS, matmul.lower),
    Schedule("scan", SCANS, scan.lower),
    Schedule("pooling", POOLS, pooling.lower),
    Schedule("flip", FLIPS, flip.lower),
    Schedule("convolution", CONVOLUTIONS, conv.lower),
    Schedule("concat", CONCATS, concat.lower_cat),
    Schedule("split", SPLITS, concat.lower_split),
    Schedule("recurrent", RECURRENT, recurrent.lower),
    Schedule("copy", COPIES, views.copy),
)


def _by_op(schedules: tuple[Schedule, ...]) -> dict[str, Schedule]:
    """Operator -> its schedule; an operator in two schedules is a bug in the table."""
    out: dict[str, Schedule] = {}
    for schedule in schedules:
        for op in schedule.ops:
            if op in out:
                raise RuntimeError(f"{op} is in schedules {out[op].name!r} and "
                                   f"{schedule.name!r}")
            out[op] = schedule
    return out


_SCHEDULE_OF = _by_op(SCHEDULES)


def schedule_of(op: str) -> Schedule | None:
    """The schedule that lowers ``op`` (e.g. ``"aten.sum.dim_IntList"`` -> the ``row
    reduction`` row), or None when the built-in coder has none (the lowerer then
    refuses it with :func:`services.generator.lowering.ops.refuse`)."""
    return _SCHEDULE_OF.get(op)
