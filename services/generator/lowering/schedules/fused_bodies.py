"""The bodies of a fused-rows kernel (:mod:`.fused_rows`): the one-pass body (a row in
one tile: every input loaded once) and the loops over R (one per level of dependent
reductions, online softmax and Welford's variance sharing a loop, then one for the
full-shaped outputs), written as lines of Triton for the group the plan found.

Loads and stores go through the group's :class:`~.row_layout.Layout`. The formulas:
online softmax as in Milakov & Gimelshein, "Online normalizer calculation for softmax"
(2018); variance by Welford (1962), the lanes' partial results combined by Chan et
al.'s pairwise formula (``_welford_combine``, :mod:`..emit`).
"""

from __future__ import annotations

import operator
import re
import textwrap
from typing import TYPE_CHECKING

import torch
import torch.fx

from services.generator.lowering.emit import cast_out, computed
from services.generator.lowering.ir import meta_val

if TYPE_CHECKING:
    from services.generator.lowering.lowerer import Lowerer
    from services.generator.lowering.schedules.fused_rows import Group, Reduction

_IDENT = {"sum": "0.0", "prod": "1.0", "max": '-float("inf")', "min": 'float("inf")'}
_TILE = "[BLOCK_R, BLOCK_I]"
_ROW = "[1, BLOCK_I]"



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


def _deps_of(g: Group, n: object) -> set[torch.fx.Node]:
    return _red_deps(g, n, {}) if isinstance(n, torch.fx.Node) else set()


def _varying(leaf: torch.fx.Node, rank: int) -> list[int]:
    """The dims of a ``rank``-d shape along which ``leaf`` (broadcast to it) varies."""
    shape = meta_val(leaf).shape
    off = rank - len(shape)
    return [d for d in range(off, rank)
            if isinstance(shape[d - off], torch.SymInt) or int(shape[d - off]) != 1]


def gather_dim(leaf: torch.fx.Node, rank: int) -> int | None:
    """The one dim (not the last) of the group's ``rank``-d view along which a leaf
    read after it varies, or None (then it is loaded per element)."""
    dims = _varying(leaf, rank)
    return dims[0] if len(dims) == 1 and dims[0] < rank - 1 else None


class _Kernel:
    """Lines of one fused kernel being written: leaf loads, chains, reductions."""

    def __init__(self, lw: Lowerer, g: Group, leaves: list[torch.fx.Node]) -> None:
        self.lw, self.g = lw, g
        self.leaves = {leaf: f"v_in{k}" for k, leaf in enumerate(leaves)}
        self.load = dict(self.leaves)  # and the reductions, once computed
        self.scalars: dict[torch.fx.Node, str] = {}
        self.ops: list[str] = []
        self.gather: dict[torch.fx.Node, int] = {}  # leaf after the view -> its one dim

    def chain(self, node: torch.fx.Node, tile: str, memo: dict, body: list[str]) -> str:
        memo.update(self.scalars)
        if self.g.view2 is not None and self.g.view2 not in memo and node in self.g.frame2:
            # the view's elements are its source's, in the same order
            memo[self.g.view2] = self.chain(self.g.view2.args[0], tile, memo, body)
        var = self.lw.chain(node, self.load, tile, body, self.ops, memo)
        for n, v in memo.items():
            if self.lw.values.get(n) is not None and self.lw.values[n].kind in ("sym", "const"):
                self.scalars[n] = v
        return var

    def loads(self, text: str, hoisted: bool = False) -> list[str]:
        """Load lines of the leaves ``text`` reads: the ``col`` leaves (loaded once, at
        the kernel's top) when ``hoisted``, else the others."""
        out: list[str] = []
        lay = self.g.layout
        for leaf, var in self.leaves.items():
            kind = lay.classes[leaf]
            if (kind == "col") == hoisted and re.search(rf"\b{var}\b", text):
                k = var.removeprefix("v_in")
                if kind == "f2":
                    self._frame2_load(leaf, var, k, out)
                    continue
                off, mask = lay.offset(f"in{k}", kind)
                ld = f"tl.load(in{k}_ptr + {off}, mask={mask}, other=0)"
                out.append(f"{var} = {computed(leaf, ld)}")
        return out

    def _frame2_load(self, leaf: torch.fx.Node, var: str, k: str, out: list[str]) -> None:
        """Lines loading a leaf read after the group's view into ``out``: the element's
        row-major index in the source (``flat``) split into the view's indices
        ``f2_d``, then the leaf's strides (its extent-1 dims skipped).

        A leaf that varies along one dim ``d`` of the view only (group norm's
        per-channel weight) is loaded compactly instead: each column of the tile
        spans a run of consecutive values of ``flat // (extent of the dims after
        d)``, so the ``BLOCK_G`` values of that run are loaded once per column and
        spread over the tile with ``tl.gather``; each lane of a load counts (the
        traffic counter's rule), so a per-element load would cost a full tile."""
        rank2 = len(meta_val(self.g.view2).shape)
        if not any(line.startswith("f2_0 = ") for line in out):
            out += [f"flat = {self.g.layout.offset('flat')[0]}", "rest = flat"]
            for d in range(rank2 - 1, 0, -1):
                out += [f"f2_{d} = rest % F2_{d}", f"rest = rest // F2_{d}"]
            out.append("f2_0 = rest")
        d = self.gather.get(leaf)
        if d is not None:
            g = f"g{d}_"
            if not any(line.startswith(f"{g}at = ") for line in out):
                suf = " * ".join(f"F2_{e}" for e in range(d + 1, rank2))
                out += [f"{g}blk = flat // ({suf})",
                        f"{g}base = tl.min(tl.where(mask, {g}blk, 2**62), axis=0)",
                        f"{g}top = tl.max(tl.where(mask, {g}blk, -1), axis=0)",
                        f"{g}k = tl.arange(0, BLOCK_G)",
                        f"{g}c = ({g}base[None, :] + {g}k[:, None]) % F2_{d}",
                        f"{g}mask = i_mask[None, :] & ({g}k[:, None] <= ({g}top - {g}base)[None, :])",
                        f"{g}at = tl.where(mask, {g}blk - {g}base[None, :], 0).to(tl.int32)"]
            ld = f"tl.load(in{k}_ptr + {g}c * in{k}_t{d}, mask={g}mask, other=0)"
            out.append(f"{var} = tl.gather({computed(leaf, ld)}, {g}at, 0)")
            return
        terms = [f"f2_{e} * in{k}_t{e}" for e in _varying(leaf, rank2)]
        ld = f"tl.load(in{k}_ptr + {' + '.join(terms) or 'f2_0 * 0'}, mask=mask, other=0)"
        out.append(f"{var} = {computed(leaf, ld)}")

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
