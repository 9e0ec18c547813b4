"""How a fused-rows kernel (:mod:`.fused_rows`) addresses its rows: the layout of the
``(outer, R, inner)`` view, the loads of each leaf and the stores of full-shaped outputs.

Three layouts, chosen at lowering time from the graph's dims (never from the sizes):

- ``rows``: the reduced dims ``[a, b)`` are adjacent; program ``(o, j)`` reduces row
  ``o`` for ``BLOCK_I`` inner columns (dims after ``b``), as :mod:`.reduction` does;
- ``cols``: the reduced dims are the trailing ones (layer norm, softmax over the last
  dim) and the ``rows`` launch parameter is above 1: the view is transposed to
  ``(1, R, outer)``, so one program reduces ``BLOCK_I`` rows at once (its columns). A
  leaf the same for every row (layer norm's weight and bias) is then loaded once per
  program instead of once per row;
- ``split``: the reduced dims are a leading and a trailing block around the kept ones
  (batch norm's statistics over N, H, W per channel C): the view is ``(K, P, S)``
  (kept, leading, trailing) and the row index ``r`` over ``P * S`` is split into
  ``r_hi = r // R_LO`` and ``r_lo = r % R_LO`` (``R_LO = S``), so no copy permutes the
  input.

Leaves are loaded by what they broadcast over (their extent-1 dims): a ``col`` leaf,
the same along R (a per-row statistic, a channel's affine in batch norm), as one
``[1, BLOCK_I]`` load at the kernel's top; a ``row`` leaf, the same for every row
(layer norm's weight), as ``[BLOCK_R, 1]``; any other as the full ``[BLOCK_R,
BLOCK_I]`` tile. Each lane of a load moves its element, so a broadcast loaded as a
tile costs as much as a tensor of the tile's shape (docs/verification.md, "Counted
traffic").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from services.generator.lowering.emit import prod
from services.generator.lowering.ir import meta_val


def _one(shape: torch.Size, d: int) -> bool:
    """Whether dim ``d`` has extent 1 fixed in the graph (it indexes nothing)."""
    return not isinstance(shape[d], torch.SymInt) and int(shape[d]) == 1


def span(dims: list[int], shape: torch.Size) -> tuple[int, int] | None:
    """The dims ``[a, b)`` that hold every reduced dim of extent other than 1 and
    nothing else but extent-1 dims, or None when the reduced dims are apart.

    An extent of 1 fixed in the graph (InstanceNorm's ``view(1, N * C, H, W)`` reduced
    over dims 0, 2, 3) indexes nothing, so it does not separate the others: such rows
    are still contiguous."""
    real = [d for d in dims if not _one(shape, d)] or dims[:1]
    a, b = real[0], real[-1] + 1
    if all(d in dims or _one(shape, d) for d in range(a, b)):
        return a, b
    return None


def kept_block(dims: list[int], shape: torch.Size) -> tuple[int, int] | None:
    """For reduced dims that are a leading and a trailing block (batch norm's 0, 2, 3):
    the kept dims ``[a, b)`` between them, else None."""
    rank = len(shape)
    kept = [d for d in range(rank) if d not in dims and not _one(shape, d)]
    if not kept:
        return None
    a, b = kept[0], kept[-1] + 1
    if any(d in dims and not _one(shape, d) for d in range(a, b)):
        return None
    if not any(d in dims and not _one(shape, d) for d in range(a)) or not any(
            d in dims and not _one(shape, d) for d in range(b, rank)):
        return None  # one block of reduced dims: span() covers it
    return a, b


@dataclass
class Layout:
    """A fused-rows kernel's view of its rows.

    mode: ``rows`` | ``cols`` | ``split``; ``a, b``: the reduced dims (``rows``,
    ``cols``) or the kept dims (``split``); classes: each leaf's load (``full``,
    ``col``, ``row``).
    """

    mode: str
    a: int
    b: int
    rank: int
    classes: dict[torch.fx.Node, str] = field(default_factory=dict)

    @classmethod
    def of(cls, dims: list[int], shape: torch.Size, rows: int) -> Layout | None:
        """The layout for reduced ``dims`` of a source of ``shape``; ``rows``: the
        launch parameter (rows per program where the rows are the trailing dims)."""
        rank = len(shape)
        ab = span(dims, shape)
        if ab is not None:
            mode = "cols" if ab[1] == rank and ab[0] > 0 and rows > 1 else "rows"
            return cls(mode, ab[0], ab[1], rank)
        ab = kept_block(dims, shape)
        return None if ab is None else cls("split", ab[0], ab[1], rank)

    def reduced(self) -> list[int]:
        if self.mode == "split":
            return [d for d in range(self.rank) if not self.a <= d < self.b]
        return list(range(self.a, self.b))

    def classify(self, leaf: torch.fx.Node) -> str:
        """``col``, ``row`` or ``full``: the load a leaf (broadcast to the source's
        shape) gets."""
        shape = getattr(meta_val(leaf), "shape", ())
        off = self.rank - len(shape)

        def bc(d: int) -> bool:
            return d < off or _one(shape, d - off)

        red = self.reduced()
        if all(bc(d) for d in red):
            return "col"
        if all(bc(d) for d in range(self.rank) if d not in red):
            return "row"
        return "full"

    # ---- forward ----------------------------------------------------------------

    def sizes(self, shape: str) -> tuple[str, str]:
        """Forward expressions: the 3-d sizes a tensor of the source's shape is
        reshaped to, and the ``(outer, R, inner)`` sizes of the kernel."""
        rank = self.rank
        part = [prod([f"{shape}[{d}]" for d in ds]) for ds in (
            range(self.a), range(self.a, self.b), range(self.b, rank))]
        if self.mode == "split":  # (P, K, S) -> (outer K, R = P * S, inner 1)
            return f"({', '.join(part)})", f"({part[1]}, {part[0]} * {part[2]}, 1)"
        three = f"({', '.join(part)})"
        if self.mode == "cols":
            return three, f"(1, {part[1]}, {part[0]})"
        return three, three

    def view(self, expr: str, three: str) -> str:
        """A forward expression viewing ``expr`` (of the source's shape) as the
        kernel reads it: three strides per tensor."""
        perm = {"rows": "", "cols": ".permute(2, 1, 0)", "split": ".permute(1, 0, 2)"}
        return f"{expr}.reshape({three}){perm[self.mode]}"

    def flat_strides(self, three: str) -> str:
        """A forward expression: the strides, in the kernel's order, of a contiguous
        tensor of the source's shape (its elements' row-major index)."""
        base = [f"{three}[1] * {three}[2]", f"{three}[2]", "1"]
        order = {"rows": base, "cols": base[::-1], "split": [base[1], base[0], base[2]]}
        return f"*({', '.join(order[self.mode])})"

    # ---- kernel text ------------------------------------------------------------

    def stride_names(self, base: str) -> list[str]:
        if self.mode == "split":
            return [f"{base}_so", f"{base}_sp", f"{base}_sr"]
        return [f"{base}_so", f"{base}_sr", f"{base}_si"]

    def r_lines(self, first: str) -> list[str]:
        """Lines defining ``r`` (from ``first``), its parts and the tile mask."""
        lines = [f"r = {first}"]
        if self.mode == "split":
            lines += ["r_hi = r // R_LO", "r_lo = r % R_LO"]
        return lines + ["mask = (r[:, None] < R) & i_mask[None, :]"]

    def r_offset(self, base: str) -> str:
        if self.mode == "split":
            return f"r_hi[:, None] * {base}_sp + r_lo[:, None] * {base}_sr"
        return f"r[:, None] * {base}_sr"

    def offset(self, base: str, kind: str = "full") -> str:
        """The element offsets of tensor ``base`` (``in3``, ``out0``) a load of
        ``kind`` reads, and its mask."""
        i = " + i[None, :] * 0" if self.mode == "split" else f" + i[None, :] * {base}_si"
        if kind == "col":
            return f"o * {base}_so{i}", "i_mask[None, :]"
        if kind == "row":
            return f"o * {base}_so + {self.r_offset(base)}", "(r < R)[:, None]"
        return f"o * {base}_so + {self.r_offset(base)}{i}", "mask"
