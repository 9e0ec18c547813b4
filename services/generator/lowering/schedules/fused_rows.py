"""Schedule ``fused rows``: row-wise reductions with their element-wise prologue and
epilogues in one kernel (softmax, log_softmax, layer and RMS norms, L1/L2/Frobenius
norms, logsumexp, row-wise losses).

When the lowerer reaches a reduction (:mod:`.reduction`), :func:`plan` looks ahead in
the graph for the nodes that work on the same rows: further reductions over the same
dims of a value of the same shape (softmax's sum after its amax), element-wise nodes
of the row's shape (the epilogue ``exp(x - max) / sum``) and element-wise nodes of
the reduced shape (``rsqrt(var + eps)``). The group becomes one kernel over the
``(outer, R, inner)`` view of the rows; a group node is stored only where something
outside the group (or the Model's output) reads it.

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

The block size thus decides the passes, and ``online`` and ``row_fusion`` (0: each
reduction its own kernel, :mod:`.reduction`) are schedule choices the evolve search
compares by modeled time. Reductions over non-adjacent dims, index-valued reductions
and groups of one node are left to :mod:`.reduction`.
"""

from __future__ import annotations

import operator
import re
import textwrap
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.fx

from services.generator.lowering.emit import add_kernel, cast_out, computed, prod
from services.generator.lowering.ir import Value, bind_args, meta_val
from services.generator.lowering.schedules.row_layout import Layout

if TYPE_CHECKING:
    from services.generator.lowering.lowerer import Lowerer

# Reduction operator name -> the accumulator kind it uses here.
KINDS = {"sum": "sum", "mean": "sum", "amax": "max", "amin": "min", "prod": "prod",
         "var": "var", "var_mean": "var", "any": "max", "all": "min"}
_IDENT = {"sum": "0.0", "prod": "1.0", "max": '-float("inf")', "min": 'float("inf")'}
_TILE = "[BLOCK_R, BLOCK_I]"
_ROW = "[1, BLOCK_I]"


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
    from services.generator.lowering.registry import REDUCTIONS

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
    exist already (a parameter): a line of forward, no kernel, so a group may read it
    before the lowerer reaches it. Returns whether ``n`` has its value."""
    from services.generator.lowering.registry import schedule_of

    if n in lw.values:
        return True
    if n.op != "call_function" or schedule_of(str(n.target)) != "view":
        return False
    for a in n.all_input_nodes:
        if not (_early_view(lw, a) and lw.values[a].kind in ("tensor", "sym", "const")):
            return False
    lw.call(n)
    return True


def plan(lw: Lowerer, node: torch.fx.Node) -> Group | None:
    """The fused group starting at reduction ``node``, or None when there is nothing
    to fuse (then :mod:`.reduction` lowers it alone)."""
    from services.generator.lowering.registry import CONSTANTS, POINTWISE_OPS, TL_DTYPES

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
        if str(m.target) not in POINTWISE_OPS or isinstance(val, tuple | list):
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


def _red_deps(g: Group, n: torch.fx.Node, seen: dict) -> set[torch.fx.Node]:
    """The group's reductions ``n`` depends on through group nodes (a getitem is its
    var_mean)."""
    if n not in g.level:
        return set()
    if n in seen:
        return seen[n]
    if n.target is operator.getitem:
        out = {n.all_input_nodes[0]}
    elif n in g.reds:
        out = {n}
    else:
        out = set().union(*(_red_deps(g, a, seen) for a in n.all_input_nodes))
    seen[n] = out
    return out


def _online_max(g: Group, red: Reduction) -> torch.fx.Node | None:
    """For ``sum(exp(y - c))`` with ``c`` the group's ``m = amax(y)`` or an element-wise
    value of it alone: that amax (the sum is ``sum(exp(y - m)) * exp(m - c)``)."""
    from services.generator.lowering.registry import POINTWISE_OPS

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


def _deps_of(g: Group, n: object) -> set[torch.fx.Node]:
    return _red_deps(g, n, {}) if isinstance(n, torch.fx.Node) else set()


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


class _Kernel:
    """Lines of one fused kernel being written: leaf loads, chains, reductions."""

    def __init__(self, lw: Lowerer, g: Group, leaves: list[torch.fx.Node]) -> None:
        self.lw, self.g = lw, g
        self.leaves = {leaf: f"v_in{k}" for k, leaf in enumerate(leaves)}
        self.load = dict(self.leaves)  # and the reductions, once computed
        self.scalars: dict[torch.fx.Node, str] = {}
        self.ops: list[str] = []

    def chain(self, node: torch.fx.Node, tile: str, memo: dict, body: list[str]) -> str:
        memo.update(self.scalars)
        var = self.lw.chain(node, self.load, tile, body, self.ops, memo)
        for n, v in memo.items():
            if self.lw.values.get(n) is not None and self.lw.values[n].kind in ("sym", "const"):
                self.scalars[n] = v
        return var

    def loads(self, text: str, hoisted: bool = False) -> list[str]:
        """Load lines of the leaves ``text`` reads: the ``col`` leaves (loaded once, at
        the kernel's top) when ``hoisted``, else the others."""
        out = []
        lay = self.g.layout
        for leaf, var in self.leaves.items():
            kind = lay.classes[leaf]
            if (kind == "col") == hoisted and re.search(rf"\b{var}\b", text):
                k = var.removeprefix("v_in")
                off, mask = lay.offset(f"in{k}", kind)
                ld = f"tl.load(in{k}_ptr + {off}, mask={mask}, other=0)"
                out.append(f"{var} = {computed(leaf, ld)}")
        return out

    def src_expr(self, red: Reduction, memo: dict, body: list[str]) -> str:
        x = self.chain(red.src, _TILE, memo, body)
        if meta_val(red.src).dtype == torch.bool:
            x = f"({x}).to(tl.float32)"
        return x

    def reduced_nodes(self, done: set, memo: dict, lines: list[str]) -> None:
        """Element-wise nodes of the reduced shape whose reductions are all in ``done``."""
        for n in self.g.nodes:
            if self.g.level[n] == "reduced" and n not in self.g.reds and n not in memo \
                    and n.target is not operator.getitem and _deps_of(self.g, n) <= done:
                self.chain(n, _ROW, memo, lines)


def _finish(red: Reduction, acc: str, lines: list[str], var: str) -> None:
    """Lines reducing the [BLOCK_R, BLOCK_I] accumulator ``acc`` into ``var`` ([1, BLOCK_I])."""
    if red.kind == "sum":
        lines.append(f"{var} = tl.sum({acc}, axis=0)[None, :]")
    elif red.kind == "prod":
        lines.append(f"{var} = tl.reduce({acc}, 0, _mul_combine)[None, :]")
    else:  # max / min: NaN anywhere in a row gives NaN, as torch
        pick = "tl.max" if red.kind == "max" else "tl.min"
        lines.append(f"{var} = tl.where(tl.max(({acc} != {acc}).to(tl.int32), axis=0) > 0, "
                     f"float('nan'), {pick}({acc}, axis=0))[None, :]")
    if red.name == "mean":
        lines.append(f"{var} = {var} / R")
    if red.name in ("any", "all"):
        lines.append(f"{var} = {var} != 0.0")


_COMBINE = {"sum": "{a} + {x}", "prod": "{a} * {x}",
            "max": "tl.where(({x} > {a}) | ({x} != {x}), {x}, {a})",
            "min": "tl.where(({x} < {a}) | ({x} != {x}), {x}, {a})"}


def _bind(k: _Kernel, red: Reduction, var: str, mean: str | None = None) -> None:
    """Make the reduction's value (or var_mean's getitems) readable by later chains."""
    if red.name == "var_mean":
        for n in k.g.nodes:
            if n.target is operator.getitem and n.all_input_nodes[0] is red.node:
                k.load[n] = var if n.args[1] == 0 else mean
    else:
        k.load[red.node] = var


def _one_pass(k: _Kernel) -> list[str]:
    lines = k.g.layout.r_lines("tl.arange(0, BLOCK_R)")
    memo: dict = {}
    done: set = set()
    for red in k.g.reds.values():
        x = k.src_expr(red, memo, lines)
        var = f"red_{red.node.name}"
        if red.kind == "var":
            mean = f"mean_{red.node.name}"
            lines += [f"{mean} = tl.sum(tl.where(mask, {x}, 0.0), axis=0)[None, :] / R",
                      f"d_{red.node.name} = tl.where(mask, {x} - {mean}, 0.0)",
                      f"{var} = tl.sum(d_{red.node.name} * d_{red.node.name}, axis=0)[None, :]"
                      f" / tl.maximum(R - {red.correction}, 0.0)"]
            _bind(k, red, var, mean)
        else:
            _finish(red, f"tl.where(mask, {x}, {_IDENT[red.kind]})", lines, var)
            _bind(k, red, var)
        done.add(red.node)
        k.reduced_nodes(done, memo, lines)
    lines += _stores(k, memo, lines, full=True) + _stores(k, memo, lines, full=False)
    return _with_loads(k, lines)


def _with_loads(k: _Kernel, lines: list[str]) -> list[str]:
    """``lines`` with the leaf loads they need inserted after the mask (one pass)."""
    head = len(k.g.layout.r_lines(""))
    return lines[:head] + k.loads("\n".join(lines[head:])) + lines[head:]


def _stores(k: _Kernel, memo: dict, lines: list[str], full: bool) -> list[str]:
    out: list[str] = []
    for j, n in enumerate(k.g.outputs):
        if (k.g.level[n] == "full") != full:
            continue
        dtype = meta_val(n).dtype
        if full:
            v = k.chain(n, _TILE, memo, lines)
            off, _ = k.g.layout.offset(f"out{j}")
            out.append(f"tl.store(out{j}_ptr + {off}, tl.broadcast_to(("
                       f"{cast_out(v, dtype, '')}).to(out{j}_ptr.dtype.element_ty), {_TILE}), "
                       "mask=mask)")
        else:
            v = k.load.get(n) or k.chain(n, _ROW, memo, lines)
            out.append(f"tl.store(out{j}_ptr + o * INNER + i[None, :], tl.broadcast_to("
                       f"({cast_out(v, dtype, '')}).to(out{j}_ptr.dtype.element_ty), {_ROW}), "
                       "mask=i_mask[None, :])")
    return out


def _loop(k: _Kernel) -> list[str]:
    """The head of a loop over R in BLOCK_R tiles."""
    return ["for r0 in range(0, R, BLOCK_R):",
            *("    " + line for line in k.g.layout.r_lines("r0 + tl.arange(0, BLOCK_R)"))]


def _loops(k: _Kernel, online: bool) -> list[str]:
    lines: list[str] = []
    top: dict = {}  # reduced-shape values, computed outside the loops
    done: set = set()
    reds = list(k.g.reds.values())
    merged = {red.node for red in reds if online and red.online_of is not None}
    levels = sorted({red.level for red in reds})
    if not online:  # one loop per reduction, in dependency order
        passes = [[red] for red in sorted(reds, key=lambda r: r.level)]
    else:
        passes = [[red for red in reds if red.level == lv and red.node not in merged]
                  for lv in levels]
        passes = [group for group in passes if group]
    for group in passes:
        if not online and group[0].kind == "var":
            lines += _var_two_loops(k, group[0], top)
            done.add(group[0].node)
            k.reduced_nodes(done, top, lines)
            continue
        init, body, fin = [], [], []
        memo = dict(top)
        for red in group:
            x = k.src_expr(red, memo, body)
            a = f"acc_{red.node.name}"
            partner = next((s for s in reds if s.node in merged and s.online_of is red.node), None)
            if red.kind == "var" and online:
                n_, m2 = f"n_{red.node.name}", f"m2_{red.node.name}"
                init += [f"{a} = tl.zeros({_TILE}, tl.float32)", f"{m2} = tl.zeros({_TILE}, tl.float32)",
                         f"{n_} = tl.zeros({_TILE}, tl.float32)"]
                body += [f"{n_} = {n_} + mask.to(tl.float32)",
                         f"d_{red.node.name} = tl.where(mask, {x} - {a}, 0.0)",
                         f"{a} = {a} + d_{red.node.name} / tl.maximum({n_}, 1.0)",
                         f"{m2} = {m2} + tl.where(mask, d_{red.node.name} * ({x} - {a}), 0.0)"]
                var, mean = f"red_{red.node.name}", f"mean_{red.node.name}"
                fin += [f"{mean}, {m2}, {n_} = tl.reduce(({a}, {m2}, {n_}), 0, _welford_combine)",
                        f"{mean} = {mean}[None, :]",
                        f"{var} = {m2}[None, :] / tl.maximum(R - {red.correction}, 0.0)"]
                _bind(k, red, var, mean)
                continue
            init.append(f"{a} = tl.full({_TILE}, {_IDENT[red.kind]}, tl.float32)")
            xm = f"x_{red.node.name}"
            body.append(f"{xm} = tl.where(mask, {x}, {_IDENT[red.kind]})")
            if partner is not None:  # online softmax: the running sum follows the max
                s = f"acc_{partner.node.name}"
                init.append(f"{s} = tl.zeros({_TILE}, tl.float32)")
                body += [f"new_{a} = {_COMBINE['max'].format(a=a, x=xm)}",
                         f"{s} = tl.where(new_{a} == -float('inf'), 0.0, "
                         f"{s} * tl.exp({a} - new_{a}) + tl.exp({xm} - new_{a}))",
                         f"{a} = new_{a}"]
            else:
                body.append(f"{a} = {_COMBINE[red.kind].format(a=a, x=xm)}")
            var = f"red_{red.node.name}"
            _finish(red, a, fin, var)
            _bind(k, red, var)
            if partner is not None:
                pv = f"red_{partner.node.name}"
                fin.append(f"{pv} = tl.sum(tl.where({a} == -float('inf'), 0.0, "
                           f"{s} * tl.exp({a} - {var})), axis=0)[None, :]")
                _bind(k, red, var)
                done.add(red.node)
                if partner.shift is not None and partner.shift is not red.node:
                    k.reduced_nodes(done, top, fin)
                    cv = k.chain(partner.shift, _ROW, top, fin)
                    fin.append(f"{pv} = tl.where({var} == {cv}, {pv}, {pv} * tl.exp({var} - {cv}))")
                _bind(k, partner, pv)
                done.add(partner.node)
        loop_body = k.loads("\n".join(body)) + body
        lines += init + _loop(k) + textwrap.indent("\n".join(loop_body), "    ").split("\n") + fin
        done |= {red.node for red in group}
        k.reduced_nodes(done, top, lines)
    tail = _stores(k, top, lines, full=False)
    lines += tail
    if any(k.g.level[n] == "full" for n in k.g.outputs):
        body = []
        stores = _stores(k, dict(top), body, full=True)
        loop_body = k.loads("\n".join(body + stores)) + body + stores
        lines += _loop(k) + textwrap.indent("\n".join(loop_body), "    ").split("\n")
    return lines


def _var_two_loops(k: _Kernel, red: Reduction, top: dict) -> list[str]:
    """Variance without ``online``: a loop for the mean, then one for the squares."""
    lines: list[str] = []
    name = red.node.name
    var, mean = f"red_{name}", f"mean_{name}"
    for step in ("mean", "squares"):
        body: list[str] = []
        x = k.src_expr(red, dict(top), body)
        if step == "mean":
            body.append(f"acc_{name} = acc_{name} + tl.where(mask, {x}, 0.0)")
            fin = [f"{mean} = tl.sum(acc_{name}, axis=0)[None, :] / R"]
        else:
            body += [f"d_{name} = tl.where(mask, {x} - {mean}, 0.0)",
                     f"acc_{name} = acc_{name} + d_{name} * d_{name}"]
            fin = [f"{var} = tl.sum(acc_{name}, axis=0)[None, :] / tl.maximum(R - {red.correction}, 0.0)"]
        loop_body = k.loads("\n".join(body)) + body
        lines += [f"acc_{name} = tl.zeros({_TILE}, tl.float32)", *_loop(k),
                  *textwrap.indent("\n".join(loop_body), "    ").split("\n"), *fin]
    _bind(k, red, var, mean)
    return lines


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
                        lay.classes[leaf] = lay.classify(leaf)
    for n in g.nodes:  # element-wise group nodes are computed by the chains below
        lw.values[n] = Value("fused" if n in g.reds or n.target is operator.getitem
                             else "pointwise")
    k = _Kernel(lw, g, leaves)
    lw.scalars = []
    one = _one_pass(k)
    k.load = dict(k.leaves)
    many = _loops(k, bool(lw.p.get("online", 1)))
    text = "\n".join(one + many)
    params, launch = [], []
    for j, leaf in enumerate(leaves):
        if not re.search(rf"\bv_in{j}\b", text):
            continue
        var = lw.fresh("rows_view")
        lw.forward.append(f"{var} = {lay.view(f'{lw.values[leaf].expr}.expand({src_shape})', three)}")
        params += [f"in{j}_ptr", *lay.stride_names(f"in{j}")]
        launch += [var, f"*{var}.stride()"]
    params += [name for name, _ in lw.scalars]
    launch += [expr for _, expr in lw.scalars]
    outs, out_params, out_launch = [], [], []
    for j, n in enumerate(g.outputs):
        val = meta_val(n)
        if g.level[n] == "full":
            shape = src_shape
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
    kparams = [*params, *out_params, "R", "INNER", *split,
               "BLOCK_R: tl.constexpr", "BLOCK_I: tl.constexpr", "ONE_PASS: tl.constexpr"]
    views = {"rows": "[outer, R, inner]", "cols": "[1, R, rows] (a program reduces BLOCK_I "
             "rows)", "split": "[kept, R_hi, R_lo] (r = r_hi * R_LO + r_lo)"}[lay.mode]
    doc = (f"Fused rows: {' -> '.join(ops)}.\n\n"
           f"Tensor k is read as {views} through its strides; ONE_PASS: the row fits one "
           "[BLOCK_R, BLOCK_I] tile, loaded once; else loops over R.")
    add_kernel(lw, kname, kparams, doc, lines, ops)
    block = lw.p["block_size"]
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
        from services.generator.lowering.schedules.reduction import row_tiles

        block_i = str(row_tiles(lw, g.src, list(range(lay.a, lay.b)))[1]
                      if lay.mode == "rows" else 1)
        head = [f"    one_pass = {np2} * {block_i} <= {block}"]
    lw.forward += [
        f"if {sizes}[0] * {sizes}[2] > 0:", *head,
        f"    {kname}[({sizes}[0], triton.cdiv({sizes}[2], {block_i}))](",
        f"        {args},",
        f"        BLOCK_R={np2} if one_pass else max(1, {block} // {block_i}), "
        f"BLOCK_I={block_i}, ONE_PASS=one_pass,",
        f"        num_warps={lw.p['num_warps']}, num_stages={lw.p['num_stages']})",
    ]


def try_lower(lw: Lowerer, node: torch.fx.Node) -> bool:
    """Lower ``node`` with the reductions and element-wise nodes fused with it; False
    when there is no group to fuse (the caller lowers the reduction alone)."""
    g = plan(lw, node)
    if g is None:
        return False
    lower(lw, g)
    return True
