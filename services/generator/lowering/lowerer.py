"""The lowerer: walks the core-ATen graph once, in order, and hands each node to the
schedule that lowers it (:func:`services.generator.lowering.registry.schedule_of`).

It owns what the schedules share: each node's :class:`Value` so far, the forward's
lines, the kernels written, fresh names, and the translation of sizes (SymInts and the
extents torch.export fixed) into Python expressions read from the inputs at run time.
Element-wise nodes are not written where they stand: a kernel that reads one computes
it, with the whole chain of element-wise nodes behind it (:meth:`Lowerer.chain`), so a
chain is one kernel and its intermediates never reach memory.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any

import torch
import torch.fx

from services.generator.lowering.emit import literal, render, torch_dtype_name
from services.generator.lowering.errors import LoweringError
from services.generator.lowering.ir import (
    Kernel,
    PendingConv,
    PendingMatmul,
    Value,
    bind_args,
    meta_val,
    reachable,
)
from services.generator.lowering.ops import (
    CONSTANTS,
    RULES,
    SYM_OPS,
    TL_DTYPES,
    Call,
    check_dtype,
    constant_expr,
    operand_exprs,
    refuse,
)
from services.generator.lowering.parameters import attr_path
from services.generator.lowering.registry import schedule_of
from services.generator.lowering.schedules import matmul, pointwise
from services.generator.lowering.task import Task


class Lowerer:
    """Walks the core-ATen graph and writes kernels and the forward that launches them."""

    def __init__(self, ep: torch.export.ExportedProgram, task: Task, params: dict[str, int]):
        self.ep = ep
        self.task = task
        self.p = params
        self.values: dict[torch.fx.Node, Value] = {}
        self.forward: list[str] = []
        self.kernels: list[Kernel] = []
        self.counter = itertools.count()
        self.shape_vars: dict[torch.fx.Node, str] = {}
        self.device = ""
        self.symbols: dict[str, str] = {}
        self.scalars: list[tuple[str, str]] = []  # (kernel parameter, forward expression)
        self.specialized: dict[int, str] = {}
        self.pending: dict[torch.fx.Node, PendingMatmul | PendingConv] = {}
        self.needed: set[torch.fx.Node] = set()
        self.sizes = False  # while rendering a size list: ints may be specialized extents

    # ---- helpers -------------------------------------------------------------------

    def fresh(self, prefix: str) -> str:
        return f"{prefix}{next(self.counter)}"

    def sym(self, value: Any) -> str:
        """A Python expression for an int, SymInt or sym node argument."""
        if isinstance(value, torch.fx.Node):
            v = self.values[value]
            if v.kind not in ("sym", "const"):
                raise LoweringError("shape", f"a size argument {value.name} is a tensor")
            return v.expr
        if isinstance(value, torch.SymInt):
            return self.sympy(value.node.expr)
        if isinstance(value, bool | int):
            if self.sizes and not isinstance(value, bool) and value in self.specialized:
                return self.specialized[value]
            return str(int(value))
        if isinstance(value, list | tuple):
            return "(" + ", ".join(self.sym(v) for v in value) + ("," if len(value) == 1 else "") + ")"
        raise LoweringError("shape", f"unsupported size argument {value!r}")

    def size_list(self, sizes: Any) -> str:
        """A tuple expression for a view/expand size list, extents read at run time."""
        self.sizes = True
        try:
            return self.sym(list(sizes))
        finally:
            self.sizes = False

    def reshape_sizes(self, sizes: Any) -> str:
        """A view's size tuple read at run time; a fixed extent that no input extent or
        init argument explains (GroupNorm's channels per group, C // G, fixed because
        the weight fixes C) becomes -1, so reshape infers it at another size. The largest
        such extent is chosen; the others stay as they are."""
        sizes = list(sizes)
        init_ints = {v for v in self.task.init_inputs if type(v) is int}
        loose = [k for k, v in enumerate(sizes) if type(v) is int and v > 1
                 and v not in self.specialized and v not in init_ints]
        if not loose or any(type(v) is int and v == -1 for v in sizes):
            return self.size_list(sizes)
        pick = max(loose, key=lambda k: sizes[k])
        return self.size_list(sizes[:pick] + [-1] + sizes[pick + 1:])

    def sympy(self, expr: Any) -> str:
        import sympy

        if isinstance(expr, sympy.Integer):
            if self.sizes and int(expr) in self.specialized:
                return self.specialized[int(expr)]
            return str(int(expr))
        if isinstance(expr, sympy.Symbol):
            if expr.name not in self.symbols:
                raise LoweringError("shape", f"size symbol {expr.name} is not an input extent")
            return self.symbols[expr.name]
        if isinstance(expr, sympy.Add):
            return "(" + " + ".join(self.sympy(a) for a in expr.args) + ")"
        if isinstance(expr, sympy.Mul):
            return "(" + " * ".join(self.sympy(a) for a in expr.args) + ")"
        name = type(expr).__name__
        if name == "FloorDiv":
            return f"({self.sympy(expr.args[0])} // {self.sympy(expr.args[1])})"
        if name in ("Mod", "PythonMod"):
            return f"({self.sympy(expr.args[0])} % {self.sympy(expr.args[1])})"
        if name in ("Max", "Min"):
            return f"{name.lower()}({', '.join(self.sympy(a) for a in expr.args)})"
        raise LoweringError("shape", f"cannot express the size {expr} in Python")

    def shape_of(self, node: torch.fx.Node) -> str:
        """A forward expression for ``node``'s runtime shape (a tuple of ints)."""
        v = self.values[node]
        if v.kind == "tensor":
            return f"{v.expr}.shape"
        if v.kind == "matmul":
            return self.pending[node].out_shape
        if node in self.shape_vars:
            return self.shape_vars[node]
        leaves, shape_only = self.leaves(node)
        shapes = [f"{self.values[leaf].expr}.shape" for leaf in leaves]
        shapes += [self.size_list(s) for s in shape_only]
        var = self.fresh("shape")
        rank = len(meta_val(node).shape)
        self.forward.append(f"{var} = _broadcast_shape({rank}, {', '.join(shapes)})")
        self.shape_vars[node] = var
        return var

    def leaves(self, node: torch.fx.Node, keep: torch.fx.Node | None = None
               ) -> tuple[list[torch.fx.Node], list[Any]]:
        """Tensor values a pointwise chain loads, and constant-node shapes it spans.

        A matmul not launched yet is launched here (the chain reads its product from
        memory), except ``keep``: the matmul whose epilogue the chain becomes.
        """
        order: list[torch.fx.Node] = []
        shape_only: list[Any] = []
        seen: set[torch.fx.Node] = set()

        def visit(n: torch.fx.Node) -> None:
            if n in seen:
                return
            seen.add(n)
            v = self.values[n]
            if v.kind == "matmul" and n is not keep:
                matmul.emit(self, n)
                v = self.values[n]
            if v.kind in ("tensor", "matmul"):
                order.append(n)
                return
            if v.kind != "pointwise":
                return
            op = str(n.target)
            if op in CONSTANTS:
                raw = bind_args(n)
                if "size" in raw:
                    shape_only.append(raw["size"])
                elif isinstance(raw.get("self"), torch.fx.Node):
                    order_len = len(order)
                    visit(raw["self"])  # full_like: only its shape matters
                    del order_len
                return
            for arg in n.all_input_nodes:
                visit(arg)

        visit(node)
        return order, shape_only

    def kernel_chain(self, node: torch.fx.Node, load: dict[torch.fx.Node, str], tile: str,
                     body: list[str], ops: list[str], params: list[str],
                     launch: list[str]) -> str:
        """:meth:`chain` for one kernel: the scalars it needs (sizes and numbers known
        only at run time) are appended to the kernel's ``params`` and the forward's
        ``launch`` arguments; returns the variable holding ``node``."""
        self.scalars = []
        result = self.chain(node, load, tile, body, ops, {})
        params += [name for name, _ in self.scalars]
        launch += [expr for _, expr in self.scalars]
        return result

    def chain(self, node: torch.fx.Node, load: dict[torch.fx.Node, str], tile: str,
              body: list[str], ops: list[str], memo: dict[torch.fx.Node, str]) -> str:
        """Kernel lines computing ``node`` from loaded leaves; returns its variable."""
        if node in memo:
            return memo[node]
        if node in load:
            return load[node]
        if self.values[node].kind in ("sym", "const"):
            # a size or number known only at run time: a scalar kernel argument, named
            # after the forward argument it comes from when it is one (f_/i_/b_: float,
            # int, bool), else c<k>
            name = f"c{len(self.scalars)}"
            val = meta_val(node)
            if node.op == "placeholder" and isinstance(val, torch.Tensor):
                prefix = ("b" if val.dtype == torch.bool else
                          "f" if val.dtype.is_floating_point else "i")
                name = f"{prefix}_{self.values[node].expr}"
            self.scalars.append((name, self.values[node].expr))
            memo[node] = name
            return memo[node]
        op = str(node.target)
        val = meta_val(node)
        raw = bind_args(node)
        exprs: dict[torch.fx.Node, str] = {}
        for arg in node.all_input_nodes:
            if op in CONSTANTS:
                continue
            exprs[arg] = self.chain(arg, load, tile, body, ops, memo)
        if op in CONSTANTS:
            expr = constant_expr(Call(op, {}, raw), val.dtype)
        else:
            rule = RULES[op]
            expr = rule.emit(Call(op, operand_exprs(raw, exprs, rule), raw))
        expr = expr.replace("__TILE__", tile)
        var = f"v_{node.name}"
        body.append(f"{var} = {expr}  # {op}")
        ops.append(op)
        memo[node] = var
        return var

    # ---- node handlers -------------------------------------------------------------

    def run(self) -> str:
        sig = self.ep.graph_signature
        if sig.user_inputs_to_mutate:
            raise LoweringError("inputs", "the task's Model mutates its input in place; the "
                                "built-in coder cannot lower that; use the LLM coder")
        kinds = {spec.arg.name: spec for spec in sig.input_specs}
        user_specs = [spec for spec in sig.input_specs
                      if spec.kind == torch.export.graph_signature.InputKind.USER_INPUT]
        user_pos = {spec.arg.name: i for i, spec in enumerate(user_specs)}
        graph = self.ep.graph
        output = next(n for n in graph.nodes if n.op == "output")
        # Buffer updates (batch norm's running statistics) are not outputs of forward;
        # ModelNew computes the user outputs only.
        user_outputs = [n for n, spec in zip(output.args[0], sig.output_specs, strict=True)
                        if spec.kind == torch.export.graph_signature.OutputKind.USER_OUTPUT]
        needed = self.needed
        for out in user_outputs:
            if isinstance(out, torch.fx.Node):
                needed |= reachable(out) | {out}
        # symbols of input extents
        for node in graph.nodes:
            if node.op == "placeholder" and node.name in user_pos:
                val = meta_val(node)
                if isinstance(val, torch.Tensor):
                    name = self.task.arg_names[user_pos[node.name]]
                    if not self.device:
                        self.device = f"{name}.device"
                    for d, size in enumerate(val.shape):
                        if isinstance(size, torch.SymInt) and not size.node.expr.is_number:
                            key = str(size.node.expr)
                            self.symbols.setdefault(key, f"{name}.shape[{d}]")
                        elif int(size) > 1:
                            # An extent torch.export fixed because a parameter has it
                            # (LayerNorm's normalized_shape): read it at run time too, so
                            # the model built at another size still fits.
                            self.specialized.setdefault(int(size), f"{name}.shape[{d}]")
        for node in graph.nodes:
            if node.op == "placeholder":
                self.placeholder(node, kinds[node.name], user_pos)
            elif node.op == "output" or node not in needed or node in self.values:
                continue  # (a node in values was lowered with an earlier one: fused)
            elif node.op == "call_function":
                self.call(node)
            else:
                raise refuse(str(node.target), "graph node " + node.op)
        if not self.device:
            self.device = "self._device_hint"
            raise LoweringError("inputs", "the task has no tensor input; the built-in coder "
                                "needs one to place its outputs")
        results = []
        for out in user_outputs:
            if not isinstance(out, torch.fx.Node):
                raise LoweringError("outputs", "the task's Model returns a constant")
            results.append(self.materialize(out))
        spec = self.ep.call_spec.out_spec
        single = spec is None or spec.is_leaf() or (len(results) == 1 and spec.num_leaves == 1
                                                    and spec.type is None)
        if single and len(results) == 1:
            self.forward.append(f"return {results[0]}")
        else:
            if spec.type not in (tuple, list):
                raise LoweringError("outputs", "the task's Model returns a "
                                    f"{spec.type}; the built-in coder returns tensors or "
                                    "tuples of tensors; use the LLM coder")
            self.forward.append(f"return {', '.join(results)}" + ("," if len(results) == 1 else ""))
        return render(self)

    def placeholder(self, node: torch.fx.Node, spec: Any, user_pos: dict[str, int]) -> None:
        kind = spec.kind
        InputKind = torch.export.graph_signature.InputKind
        val = meta_val(node)
        if kind == InputKind.USER_INPUT:
            name = self.task.arg_names[user_pos[node.name]]
            if isinstance(val, torch.Tensor) and not isinstance(
                    self.task.inputs[user_pos[node.name]], torch.Tensor):
                # a number traced as a 0-d tensor: a scalar kernel argument
                self.values[node] = Value("const", name)
            elif isinstance(val, torch.Tensor):
                check_dtype(val.dtype, f"input `{name}`")
                self.values[node] = Value("tensor", name)
            elif isinstance(val, torch.SymInt | torch.SymFloat):
                self.values[node] = Value("sym", name)
            else:
                self.values[node] = Value("const", name)
        elif kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            if kind == InputKind.CONSTANT_TENSOR:
                value = self.ep.constants.get(spec.target)
                if (isinstance(value, torch.Tensor) and value.dim() == 0
                        and (value.dtype.is_floating_point or value.dtype == torch.int64)):
                    # torch.tensor(self.constant_value) in forward: a number, like the
                    # task's other Python numbers the graph holds as literals
                    number = value.item()
                    name = self.fresh("const")
                    self.forward.append(f"{name} = " + (literal(number) if isinstance(
                        number, float) else str(number)))
                    self.values[node] = Value("const", name)
                    return
                raise LoweringError("inputs", f"the task's Model holds a constant tensor "
                                    f"({spec.target}); use the LLM coder")
            path = attr_path("self", spec.target)
            self.values[node] = Value("tensor", path)
            if isinstance(val, torch.Tensor):
                # A fixed extent no input has, that a parameter does (a convolution's
                # output channels in a later view): read from the parameter at run time,
                # so ModelNew built at other init arguments still fits. Input extents
                # (set first) win.
                for d, size in enumerate(val.shape):
                    if int(size) > 1:
                        self.specialized.setdefault(int(size), f"{path}.shape[{d}]")
        else:
            raise LoweringError("inputs", f"the task's Model takes a {kind.name.lower()} "
                                "input; use the LLM coder")

    def call(self, node: torch.fx.Node) -> None:
        target = node.target
        if target is operator.getitem:
            src, index = node.args
            self.values[node] = self.values[src].items[index]
            return
        if target in SYM_OPS:
            self.sizes = True  # size arithmetic: fixed extents are read at run time too
            try:
                a, b = (self.sym(x) if not isinstance(x, torch.fx.Node) else self.values[x].expr
                        for x in node.args)
            finally:
                self.sizes = False
            self.values[node] = Value("sym", f"({a} {SYM_OPS[target]} {b})")
            return
        if not isinstance(target, torch._ops.OpOverload):
            raise refuse(str(target), "not an ATen operator")
        op = str(target)
        if op == "aten.sym_size.int":
            src, dim = node.args
            self.values[node] = Value("sym", f"{self.shape_of(src)}[{dim}]")
            return
        if op in ("aten._assert_tensor_metadata.default", "aten._assert_scalar.default",
                  "aten.sym_constrain_range_for_size.default"):
            return
        val = meta_val(node)
        vals = val if isinstance(val, tuple | list) else [val]
        for v in vals:
            if isinstance(v, torch.Tensor) and v.dtype not in TL_DTYPES and v.dtype != torch.int64:
                check_dtype(v.dtype, f"{op}'s result")
        schedule = schedule_of(op)
        if schedule is None:
            raise refuse(op)
        schedule.lower(self, node, op)

    def materialize(self, node: torch.fx.Node) -> str:
        """A forward tensor holding ``node``'s value (a pointwise kernel if needed)."""
        v = self.values[node]
        if v.kind == "matmul":
            matmul.emit(self, node)
            v = self.values[node]
        if v.kind == "tensor":
            return v.expr
        if v.kind != "pointwise":
            raise LoweringError("outputs", f"{node.name} is not a tensor")
        pointwise.lower(self, node)
        return self.values[node].expr

    def alloc(self, shape: str, dtype: torch.dtype) -> str:
        """A forward line allocating an output (``torch.empty`` of the forward expression
        ``shape``, on the inputs' device); returns its variable."""
        var = self.fresh("buf")
        self.forward.append(f"{var} = torch.empty({shape}, dtype={torch_dtype_name(dtype)}, "
                            f"device={self.device})")
        return var

    def used_by_value(self, node: torch.fx.Node, leaf: torch.fx.Node) -> bool:
        """Whether the chain reads ``leaf``'s values (full_like reads only its shape)."""
        stack, seen = [node], set()
        while stack:
            n = stack.pop()
            if n in seen or self.values[n].kind in ("tensor", "matmul"):
                continue
            seen.add(n)
            if str(n.target) in CONSTANTS:
                continue
            for arg in n.all_input_nodes:
                if arg is leaf:
                    return True
                stack.append(arg)
        return False
