"""Schedule ``fused rows``: row-wise reductions with their element-wise prologue and
epilogues in one kernel (softmax, log_softmax, layer and RMS norms, L1/L2/Frobenius
norms, logsumexp, row-wise losses).

When the lowerer reaches a reduction (:mod:`.reduction`), :func:`plan` looks ahead in
the graph for the nodes that work on the same rows: further reductions over the same
dims of a value of the same shape (softmax's sum after its amax), element-wise nodes
of the row's shape (the epilogue ``exp(x - max) / sum``) and element-wise nodes of
the reduced shape (``rsqrt(var + eps)``); views of parameters the group reads (batch
norm's ``weight.unsqueeze(-1)``) are lowered early to join it. The group becomes one
kernel over the ``(outer, R, inner)`` view of the rows (:mod:`.row_layout`: a row per
program, several short trailing rows per program, or reduced dims split around the
kept ones as batch norm's); a group node is stored only where something outside the
group (or the Model's output) reads it.

The kernel has two bodies, chosen per launch by ``ONE_PASS`` (a ``tl.constexpr``):

- **one pass**, when a row fits one tile (``next_pow2(R) * BLOCK_I <= block_size``):
  every input is loaded once, reductions and epilogue are computed from registers,
  every output stored once (traffic ratio ~1.0);
- **loops** otherwise: one loop over R per level of dependent reductions, then one for
  the full-shaped outputs. With ``online`` (the default) softmax's ``sum(exp(x - max))``
  shares its max's loop (online softmax: the running sum is rescaled when the running
  max grows, as in Milakov & Gimelshein, "Online normalizer calculation for softmax",
  2018) and variance is Welford's (Welford 1962; the lanes' partial results combined by
  Chan et al.'s pairwise formula), so softmax and layer norm read their input twice.

The bodies are written by :mod:`.fused_bodies`. The block size thus decides the
passes, and ``online``, ``rows`` and ``row_fusion`` (0: each reduction its own kernel,
:mod:`.reduction`) are schedule choices the evolve search compares by modeled time.
Reductions over dims interleaved with kept ones (other than batch norm's two blocks
around the kept ones), index-valued reductions and groups of one node are left to
:mod:`.reduction`.
"""

from __future__ import annotations

import operator
import re
import textwrap
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.fx

from services.generator.launch_configs import launch_options
from services.generator.lowering.emit import add_kernel, prod
from services.generator.lowering.ir import Value, bind_args, meta_val
from services.generator.lowering.ops import (
    CONSTANTS,
    FORWARD_VIEWS,
    POINTWISE_OPS,
    REDUCTIONS,
    TL_DTYPES,
)
from services.generator.lowering.schedules.fused_bodies import (
    _deps_of,
    _Kernel,
    _loops,
    _one_pass,
    gather_dim,
)
from services.generator.lowering.schedules.row_layout import Layout
from services.generator.lowering.schedules.rows import row_tiles

if TYPE_CHECKING:
    from services.generator.lowering.lowerer import Lowerer

# Reduction operator name -> the accumulator kind it uses here.
KINDS = {"sum": "sum", "mean": "sum", "amax": "max", "amin": "min", "prod": "prod",
         "var": "var", "var_mean": "var", "any": "max", "all": "min"}
@dataclass
class Reduction:
    """One reduction of the group: its node, source node, accumulator kind and, for
    an online sum, the max whose loop it shares."""

    node: torch.fx.Node
    src: torch.fx.Node
    kind: str
    name: str
    correction: float = 0.0
    level: int = 0
    online_of: torch.fx.Node | None = None
    shift: torch.fx.Node | None = None  # the c of an online sum(exp(y - c))


@dataclass
class Group:
    """The nodes one fused kernel computes, in graph order, with their levels."""

    src: torch.fx.Node
    dims: list[int]
    layout: Layout
    nodes: list[torch.fx.Node] = field(default_factory=list)
    level: dict[torch.fx.Node, str] = field(default_factory=dict)  # full | reduced
    reds: dict[torch.fx.Node, Reduction] = field(default_factory=dict)
    outputs: list[torch.fx.Node] = field(default_factory=list)
    # Nodes after a view of a full-shaped node to another shape of the same elements
    # (group norm's view back to N, C, H, W before its affine): ``view2`` is that view.
    frame2: set[torch.fx.Node] = field(default_factory=set)
    view2: torch.fx.Node | None = None


def _key(val: object) -> tuple[str, ...] | None:
    shape = getattr(val, "shape", None)
    return None if shape is None else tuple(str(s) for s in shape)


def _reduction(node: torch.fx.Node) -> Reduction | None:
    """The node as a fusable reduction, or None (argmax, max.dim, a 0-d source)."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return None
    op = str(node.target)
    name = op.split(".")[1]
    if name not in KINDS or name in ("max", "min"):
        return None
    if op not in REDUCTIONS:
        return None
    raw = bind_args(node)
    src = raw["self"]
    if not isinstance(src, torch.fx.Node):
        return None
    correction = 0.0
    if KINDS[name] == "var":
        c = raw.get("correction")
        correction = float(c if c is not None else (0 if raw.get("unbiased") is False else 1))
    return Reduction(node, src, KINDS[name], name, correction)


def _dims(node: torch.fx.Node, rank: int) -> list[int]:
    raw = bind_args(node)
    dims = raw.get("dim", None)
    if dims is None or dims == []:
        dims = list(range(rank))
    elif isinstance(dims, int):
        dims = [dims]
    return sorted({d % rank for d in dims}) if rank else []


def _early_view(lw: Lowerer, n: torch.fx.Node) -> bool:
    """Lower ``n`` now when it is a view (unsqueeze, reshape, ...) of tensors that
    exist already (a parameter: a line of forward, no kernel) or an element-wise node
    of such values (deferred: computed by the kernels that read it), so a group may
    read it before the lowerer reaches it. Returns whether ``n`` has its value."""
    if n in lw.values:
        return True
    op = str(n.target) if n.op == "call_function" else None
    if op not in FORWARD_VIEWS and op not in POINTWISE_OPS:
        return False
    kinds = ("tensor", "sym", "const") + (("pointwise",) if op in POINTWISE_OPS else ())
    for a in n.all_input_nodes:
        if not (_early_view(lw, a) and lw.values[a].kind in kinds):
            return False
    lw.call(n)
    return True


# Tile elements (BLOCK_R x BLOCK_I) of a kernel that spreads compactly loaded values
# with tl.gather: ptxas time grows steeply with the tile there (a group norm's kernel
# for sm_90: 3.6 s at 256 elements, 14.5 s at 512, 76 s at 1024, over 200 s at 2048),
# and the compile check compiles every specialisation a verification launches.
GATHER_TILE = 256

_VIEWS = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default")


def _view_size(m: torch.fx.Node) -> list:
    raw = bind_args(m)
    return list(raw.get("size", raw.get("shape")))


def _frame2_leaves_apart(lw: Lowerer, g: Group) -> None:
    """Drop the nodes after the group's view when a tensor is read both before and
    after it (it would need two loads of one leaf, at two indexings)."""
    if not g.frame2:
        return
    seen: dict[bool, set[torch.fx.Node]] = {True: set(), False: set()}
    for n in g.nodes:
        for a in n.all_input_nodes:
            if a not in g.level:
                seen[n in g.frame2] |= set(lw.leaves(a)[0])
    if seen[True] & seen[False]:
        g.nodes = [n for n in g.nodes if n not in g.frame2]
        for n in g.frame2:
            del g.level[n]
        g.frame2, g.view2 = set(), None


def plan(lw: Lowerer, node: torch.fx.Node) -> Group | None:
    """The fused group starting at reduction ``node``, or None when there is nothing
    to fuse (then :mod:`.reduction` lowers it alone)."""
    first = _reduction(node)
    if first is None or not lw.p.get("row_fusion", 1):
        return None
    dkey = _key(meta_val(first.src))
    rank = len(dkey or ())
    if not rank:
        return None
    dims = _dims(node, rank)
    layout = Layout.of(dims, meta_val(first.src).shape, lw.p.get("rows", 1))
    if layout is None:
        return None
    keep = tuple("1" if d in dims else dkey[d] for d in range(rank))
    squeezed = tuple(dkey[d] for d in range(rank) if d not in dims)
    g = Group(first.src, dims, layout, [node], {node: "reduced"}, {node: first})

    def fits_full(a: torch.fx.Node) -> bool:  # a group value broadcast over the rows
        if g.level.get(a) == "full":
            return True
        k = _key(meta_val(a))
        return k is not None and ("1",) * (rank - len(k)) + k == keep

    graph_nodes = list(node.graph.nodes)
    for m in graph_nodes[graph_nodes.index(node) + 1:]:
        if m.op != "call_function" or m not in lw.needed:
            continue
        ins = m.all_input_nodes
        for a in ins:  # a constant (scalar_tensor) not reached yet: computed in place
            if a not in lw.values and str(a.target) in CONSTANTS and not a.all_input_nodes:
                lw.values[a] = Value("pointwise")
            elif a not in g.level:
                _early_view(lw, a)  # a parameter's unsqueeze (batch norm's affine)
        if not any(a in g.level for a in ins) or not all(
                a in g.level or a in lw.values for a in ins):
            continue
        val = meta_val(m)
        if isinstance(val, torch.Tensor) and val.dtype not in TL_DTYPES:
            continue
        key = _key(val)
        red = _reduction(m)
        if m.target is operator.getitem:
            if ins[0] in g.reds and g.reds[ins[0]].name == "var_mean":
                g.nodes.append(m)
                g.level[m] = "reduced"
            continue
        if red is not None:
            skey = _key(meta_val(red.src))
            if skey == dkey and _dims(m, rank) == dims and (
                    red.src not in g.level or g.level[red.src] == "full"):
                g.nodes.append(m)
                g.level[m] = "reduced"
                g.reds[m] = red
            continue
        if str(m.target) in _VIEWS and g.view2 is None and g.level.get(ins[0]) == "full" \
                and ins[0] not in g.frame2 and "-1" not in lw.reshape_sizes(_view_size(m)):
            g.nodes.append(m)
            g.level[m] = "full"
            g.frame2.add(m)
            g.view2 = m
            continue
        if str(m.target) not in POINTWISE_OPS or isinstance(val, tuple | list):
            continue
        if any(a in g.frame2 for a in ins):  # after the view: the view's shape
            if key == _key(meta_val(g.view2)) and all(a in g.frame2 for a in ins
                                                       if a in g.level):
                g.nodes.append(m)
                g.level[m] = "full"
                g.frame2.add(m)
            continue
        if key == dkey:
            if all(fits_full(a) for a in ins if a in g.level):
                g.nodes.append(m)
                g.level[m] = "full"
        elif key in (keep, squeezed) and all(
                (a in g.level and g.level[a] == "reduced" and _key(meta_val(a)) == key)
                or (a not in g.level and (lw.values[a].kind in ("sym", "const")
                                          or str(a.target) in CONSTANTS)) for a in ins):
            g.nodes.append(m)
            g.level[m] = "reduced"
    _frame2_leaves_apart(lw, g)
    if len(g.nodes) == 1:
        return None
    for m in g.nodes:
        users = [u for u in m.users if u not in g.level]
        if m in g.reds and g.reds[m].name == "var_mean":
            continue  # read through its getitems
        if any(u.op == "output" or u in lw.needed for u in users):
            g.outputs.append(m)
    _levels(g)
    return g


def _online_max(g: Group, red: Reduction) -> torch.fx.Node | None:
    """For ``sum(exp(y - c))`` with ``c`` the group's ``m = amax(y)`` or an element-wise
    value of it alone: that amax (the sum is ``sum(exp(y - m)) * exp(m - c)``)."""
    e = red.src
    if red.name != "sum" or str(e.target) != "aten.exp.default":
        return None
    sub = e.all_input_nodes[0]
    if str(sub.target) != "aten.sub.Tensor" or bind_args(sub).get("alpha", 1) != 1:
        return None
    y, c = sub.args[0], sub.args[1]
    deps = _deps_of(g, c)
    if len(deps) != 1 or g.level.get(c) != "reduced":
        return None
    (m,) = deps  # c is the amax or a value of it alone (logsumexp's finite max)
    if g.reds[m].name == "amax" and g.reds[m].src is y and m not in _deps_of(g, y) \
            and all(str(n.target) in POINTWISE_OPS or n is m for n in _between(g, c, m)):
        red.shift = c
        return m
    return None


def _between(g: Group, c: torch.fx.Node, m: torch.fx.Node) -> list[torch.fx.Node]:
    """Group nodes from ``c`` back to ``m``."""
    out, stack = [], [c]
    while stack:
        n = stack.pop()
        if n in g.level and n not in out:
            out.append(n)
            if n is not m:
                stack.extend(n.all_input_nodes)
    return out


def _levels(g: Group) -> None:
    for node in g.nodes:
        red = g.reds.get(node)
        if red is None:
            continue
        deps = _deps_of(g, red.src)
        red.level = 1 + max((g.reds[d].level for d in deps), default=-1)
        m = _online_max(g, red)
        if m is not None:
            red.online_of = m


def lower(lw: Lowerer, g: Group) -> None:
    """Write the group's kernel and its launch; every group node gets its value."""
    src_shape = lw.shape_of(g.src)
    rank = len(meta_val(g.src).shape)
    lay = g.layout
    three, sizes = lw.fresh("rows3_"), lw.fresh("rows")
    three_expr, sizes_expr = lay.sizes(src_shape)
    lw.forward += [f"{three} = {three_expr}", f"{sizes} = {sizes_expr}"]
    leaves: list[torch.fx.Node] = []
    for n in g.nodes:
        for arg in n.all_input_nodes:
            if arg not in g.level:
                for leaf in lw.leaves(arg)[0]:
                    if leaf not in leaves:
                        leaves.append(leaf)
                        lay.classes[leaf] = "f2" if n in g.frame2 else lay.classify(leaf)
    for n in g.nodes:  # element-wise group nodes are computed by the chains below
        lw.values[n] = Value("fused" if n in g.reds or n.target is operator.getitem
                             else "pointwise")
    k = _Kernel(lw, g, leaves)
    if lay.mode != "split":  # a column's flat indices run in order: gather a run
        k.gather = {leaf: d for leaf in leaves if lay.classes[leaf] == "f2"
                    and (d := gather_dim(leaf, len(meta_val(g.view2).shape))) is not None}
    lw.scalars = []
    one = _one_pass(k)
    k.load = dict(k.leaves)
    many = _loops(k, bool(lw.p.get("online", 1)))
    text = "\n".join(one + many)
    params, launch = [], []
    frame2 = ""
    if g.view2 is not None:  # its extents, and the flat index of the source's elements
        frame2 = lw.fresh("frame")
        lw.forward.append(f"{frame2} = {lw.reshape_sizes(_view_size(g.view2))}")
        rank2 = len(meta_val(g.view2).shape)
        params += lay.stride_names("flat") + [f"F2_{d}" for d in range(rank2)]
        launch += [lay.flat_strides(three), f"*{frame2}"]
    for j, leaf in enumerate(leaves):
        if not re.search(rf"\bv_in{j}\b", text):
            continue
        var = lw.fresh("rows_view")
        if lay.classes[leaf] == "f2":  # read at the view's indices
            lw.forward.append(f"{var} = {lw.values[leaf].expr}.expand({frame2})")
            params += [f"in{j}_ptr", *(f"in{j}_t{d}" for d in range(rank2))]
            launch += [var, f"*{var}.stride()"]
            continue
        lw.forward.append(f"{var} = {lay.view(f'{lw.values[leaf].expr}.expand({src_shape})', three)}")
        params += [f"in{j}_ptr", *lay.stride_names(f"in{j}")]
        launch += [var, f"*{var}.stride()"]
    params += [name for name, _ in lw.scalars]
    launch += [expr for _, expr in lw.scalars]
    outs, out_params, out_launch = [], [], []
    for j, n in enumerate(g.outputs):
        val = meta_val(n)
        if g.level[n] == "full":
            shape = frame2 if n in g.frame2 else src_shape
        else:
            keepdim = len(val.shape) == rank
            kept = [(f"{src_shape}[{d}]" if d not in g.dims else "1") for d in range(rank)
                    if keepdim or d not in g.dims]
            shape = "(" + "".join(f"{s}, " for s in kept) + ")"
        outs.append(lw.alloc(shape, val.dtype))
        out_params.append(f"out{j}_ptr")
        out_launch.append(outs[-1])
        if g.level[n] == "full":  # stored through strides, as the layout views it
            out_params += lay.stride_names(f"out{j}")
            out_launch.append(f"*{lay.view(outs[-1], three)}.stride()")
    for n, out in zip(g.outputs, outs, strict=True):
        lw.values[n] = Value("tensor", out)
    for n in g.nodes:
        if n not in g.outputs:
            lw.values[n] = Value("fused")
        if n in g.reds and g.reds[n].name == "var_mean":
            lw.values[n] = Value("tuple", items=[Value("fused"), Value("fused")])
    top = k.loads(text, hoisted=True)  # the leaves the same along R: loaded once
    lines = ["o = tl.program_id(0).to(tl.int64)",
             "i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)",
             "i_mask = i < INNER", *top, "if ONE_PASS:",
             *textwrap.indent("\n".join(one), "    ").split("\n"), "else:",
             *textwrap.indent("\n".join(many), "    ").split("\n")]
    kname = lw.fresh("fused_rows_kernel_")
    ops = list(dict.fromkeys(k.ops + [str(n.target) for n in g.reds]))
    split = ["R_LO"] if lay.mode == "split" else []
    gathered = ["BLOCK_G: tl.constexpr"] if k.gather and "tl.gather(" in text else []
    kparams = [*params, *out_params, "R", "INNER", *split,
               "BLOCK_R: tl.constexpr", "BLOCK_I: tl.constexpr", "ONE_PASS: tl.constexpr",
               *gathered]
    views = {"rows": "[outer, R, inner]", "cols": "[1, R, rows] (a program reduces BLOCK_I "
             "rows)", "split": "[kept, R_hi, R_lo] (r = r_hi * R_LO + r_lo)"}[lay.mode]
    doc = (f"Fused rows: {' -> '.join(ops)}.\n\n"
           f"Tensor k is read as {views} through its strides; ONE_PASS: the row fits one "
           "[BLOCK_R, BLOCK_I] tile, loaded once; else loops over R.")
    add_kernel(lw, kname, kparams, doc, lines, ops)
    block = min(lw.p["block_size"], GATHER_TILE) if gathered else lw.p["block_size"]
    args = ", ".join([*launch, *out_launch, f"{sizes}[1]", f"{sizes}[2]",
                      *([f"{three}[2]"] if split else [])])
    np2 = f"triton.next_power_of_2(max(1, {sizes}[1]))"
    if lay.mode == "cols":  # rows per program: as many as fit a one-pass tile, <= rows
        most = f"min({lw.p.get('rows', 1)}, triton.next_power_of_2({sizes}[2]))"
        bi = lw.fresh("rows_per_program")
        head = [f"    {bi} = max(1, min({most}, {block} // {np2}))",  # longer rows loop,
                f"    one_pass = {np2} * {bi} <= {block}",  # a program each (parallelism)
                f"    {bi} = {bi} if one_pass else 1"]
        block_i = bi
    else:
        block_i = str(row_tiles(lw, g.src, list(range(lay.a, lay.b)))[1]
                      if lay.mode == "rows" else 1)
        head = [f"    one_pass = {np2} * {block_i} <= {block}"]
    block_r = lw.fresh("block_r")
    head.append(f"    {block_r} = {np2} if one_pass else max(1, {block} // {block_i})")
    extra = ""
    if gathered:  # the most runs a tile column spans: (its flat extent) // run + 2
        rank2 = len(meta_val(g.view2).shape)
        step = "1" if lay.mode == "cols" else f"{sizes}[2]"
        runs = [prod([f"{frame2}[{e}]" for e in range(d + 1, rank2)])
                for d in sorted(set(k.gather.values()))]
        exprs = [f"triton.next_power_of_2(min({block_r}, max(1, {sizes}[1])) * {step} "
                 f"// ({run}) + 2)" for run in runs]
        most_runs = exprs[0] if len(exprs) == 1 else "max(" + ", ".join(exprs) + ")"
        extra = f" BLOCK_G={most_runs},"
    lw.forward += [
        f"if {sizes}[0] * {sizes}[2] > 0:", *head,
        f"    {kname}[({sizes}[0], triton.cdiv({sizes}[2], {block_i}))](",
        f"        {args},",
        f"        BLOCK_R={block_r}, BLOCK_I={block_i}, ONE_PASS=one_pass,{extra}",
        f"        {launch_options(lw, kname, 'reduction', ['R', 'INNER'])})",
    ]


def try_lower(lw: Lowerer, node: torch.fx.Node) -> bool:
    """Lower ``node`` with the reductions and element-wise nodes fused with it; False
    when there is no group to fuse (the caller lowers the reduction alone)."""
    g = plan(lw, node)
    if g is None:
        return False
    lower(lw, g)
    return True
