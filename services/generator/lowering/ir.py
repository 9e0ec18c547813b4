"""The small typed structures the lowering keeps per graph node and per kernel.

The graph itself is torch.fx's (``torch.export``'s core-ATen graph): no IR of our own.
:class:`Value` is what one node has become in the generated code so far,
:class:`PendingMatmul` a matmul whose kernel is written when its product is first
read (:class:`PendingConv` the same for a convolution), :class:`Kernel` one emitted ``@triton.jit`` function; :func:`meta_val`,
:func:`bind_args` and :func:`reachable` read fx nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx


@dataclass
class Value:
    """What one graph node is in the generated code.

    kind: ``tensor`` (a forward expression: input, parameter, view or kernel output),
    ``pointwise`` (an element-wise node, computed inside the kernels that consume it),
    ``matmul`` (a ``tl.dot`` product not launched yet, a matmul's or a convolution's:
    the element-wise chain consuming it may become its epilogue), ``sym`` (a Python int expression), ``const`` (a number),
    ``tuple`` (``items``).
    """

    kind: str
    expr: str = ""
    items: list[Any] = field(default_factory=list)


@dataclass
class PendingMatmul:
    """A matmul whose operands exist in forward but whose kernel is not written yet.

    a, b, bias: forward expressions (bias None for mm/bmm); out_shape: a forward
    expression of the product's shape; alpha/beta: addmm's scalars; bias_row: the
    bias is one row (nn.Linear's, shape (N,)) that every row of the product adds.
    """

    op: str
    a: str
    b: str
    bias: str | None
    out_shape: str
    batched: bool
    alpha: float
    beta: float
    bias_row: bool = False


@dataclass
class PendingConv:
    """A convolution whose operands and output shape exist in forward but whose kernel
    is not written yet (``schedules/conv.py``).

    x, w, bias: forward expressions (bias None without one); out_shape: a forward
    expression of the output's shape; n: spatial dims (1-3); stride, padding, dilation,
    output_padding: the operator's, one int per spatial dim; groups: a forward
    expression of the group count; outs: forward variables of the output extents;
    direct: sum each output channel without ``tl.dot`` (few channels per group).
    """

    op: str
    x: str
    w: str
    bias: str | None
    out_shape: str
    n: int
    transposed: bool
    stride: list[int]
    padding: list[int]
    dilation: list[int]
    output_padding: list[int]
    groups: str
    outs: list[str]
    direct: bool = False


@dataclass
class Kernel:
    """One emitted ``@triton.jit`` function, its ATen ops and its launch line."""

    name: str
    source: str
    ops: list[str]


def meta_val(node: torch.fx.Node) -> Any:
    """The node's example value as torch.export recorded it (a FakeTensor, SymInt, ...)."""
    return node.meta.get("val")


def bind_args(node: torch.fx.Node) -> dict[str, Any]:
    """The node's arguments by schema name, defaults filled in."""
    schema = node.target._schema
    bound: dict[str, Any] = {}
    for index, argument in enumerate(schema.arguments):
        if index < len(node.args):
            bound[argument.name] = node.args[index]
        elif argument.name in node.kwargs:
            bound[argument.name] = node.kwargs[argument.name]
        elif argument.has_default_value():
            bound[argument.name] = argument.default_value
    return bound


def reachable(output: torch.fx.Node) -> set[torch.fx.Node]:
    """Every node ``output`` depends on, directly or not."""
    seen: set[torch.fx.Node] = set()
    stack = list(output.all_input_nodes)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen
