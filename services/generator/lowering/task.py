"""The task, run and exported: the lowering's first step, inside the sandboxed child.

:func:`load_task` runs the task's source (KernelBench format: ``class Model``,
``get_inputs()``, ``get_init_inputs()``), builds its model and example inputs (on the
meta device when the task allows) and records the Model's directly registered modules
and parameters; :func:`export_program` traces it with ``torch.export.export`` and
decomposes it to core ATen (plus the composite operators of ``_EXTRA_DECOMPOSITIONS``,
less the recurrent operators of ``_KEPT_WHOLE``).
Every failure is a :class:`LoweringError` tagged ``task``, ``inputs`` or ``export``.

This runs the task's code in this process: call it where the code is trusted, or
from a subprocess (the sandbox role ``lower``).
"""

from __future__ import annotations

import contextlib
import inspect
import types
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from services.common.task_source import (
    REQUIRED_TASK_NAMES,
    task_module_names,
    unknown_overrides_message,
)
from services.generator.lowering.errors import LoweringError

_KERNEL_NAME = "fused_elementwise_kernel"

# Names the generated forward() uses itself, so task argument names must avoid them.
_RESERVED = frozenset(
    {"self", "torch", "nn", "triton", "tl", "out", "n_elements", "grid", _KERNEL_NAME}
)


@dataclass
class Task:
    """A task run far enough to export: its model, example inputs and forward names.

    ``registered`` lists the Model's direct attributes in the order ``__init__``
    registered them: ``("module", name, module)``, ``("parameter", name, tensor)``,
    ``("buffer", name, tensor)`` or ``("tensor", name, tensor)``: a plain tensor
    attribute (``self.hidden = torch.randn(...)``), which :func:`load_task` makes a
    non-persistent buffer of ``model`` so that the export may read and update it.
    ``created`` numbers every parameter of the Model (by ``id``) in the order it was
    registered anywhere in the Model, which is the order modules were constructed (a
    ResNet block's ``downsample`` is built before the block that registers it last).
    """

    model: torch.nn.Module
    inputs: tuple[Any, ...]
    arg_names: list[str]
    init_inputs: list[Any]
    registered: list[tuple[str, str, Any]]
    module: types.ModuleType
    created: dict[int, int] = field(default_factory=dict)


def load_task(task_desc: str, shape_overrides: dict[str, Any] | None,
              progress: Any = None) -> Task:
    """Run the task source and build its model and example inputs.

    Inputs and model are built on the meta device first, so a KernelBench problem sized
    for an 80 GB GPU costs no memory; a task whose code refuses meta is built on CPU.
    ``progress(phase)`` is told each call into the task's code before it starts
    (``the task's Model(*get_init_inputs())`` ...), so that a lowering that hangs can
    name it.
    """
    def phase(what: str) -> None:
        if progress is not None:
            progress(f"the task's {what}")

    try:
        code = compile(task_desc, "<task>", "exec")
    except SyntaxError as exc:
        raise LoweringError("task", f"task source does not compile: {exc.msg} "
                            f"(line {exc.lineno}); fix the task") from exc
    module = types.ModuleType("aikg_task")
    phase("module code")
    try:
        exec(code, module.__dict__)
    except Exception as exc:
        raise LoweringError("task", f"task source raised {type(exc).__name__}: {exc}; "
                            "fix the task") from exc
    for name in REQUIRED_TASK_NAMES:
        if not hasattr(module, name):
            raise LoweringError("task", f"task source defines no `{name}`; a task needs "
                                "`class Model`, `get_inputs()` and `get_init_inputs()`")
    # The same rule as the verifier's reference: an override names a module-level name.
    unknown = sorted(n for n in (shape_overrides or {}) if not hasattr(module, n))
    if unknown:
        raise LoweringError("task", unknown_overrides_message(unknown,
                                                              task_module_names(task_desc)))
    for name, value in (shape_overrides or {}).items():
        setattr(module, name, tuple(value) if isinstance(value, list) else value)

    registered: list[tuple[str, str, Any]] = []
    created: dict[int, int] = {}
    top: list[torch.nn.Module] = []

    def on_module(owner, name, value):
        if owner is (top[0] if top else None):
            registered.append(("module", name, value))

    def on_parameter(owner, name, value):
        if top and value is not None:
            created.setdefault(id(value), len(created))
        if owner is (top[0] if top else None) and value is not None:
            registered.append(("parameter", name, value))

    def on_buffer(owner, name, value):
        if owner is (top[0] if top else None) and value is not None:
            registered.append(("buffer", name, value))

    class _Recorder:
        """Finds the top-level Model instance as soon as Module.__init__ runs on it."""

    def build() -> tuple[torch.nn.Module, list[Any], list[Any]]:
        registered.clear()
        created.clear()
        top.clear()
        phase("get_init_inputs()")
        init_inputs = list(module.get_init_inputs())
        original, original_setattr = torch.nn.Module.__init__, torch.nn.Module.__setattr__

        def init(self, *args, **kwargs):
            if not top and isinstance(self, module.Model):
                top.append(self)
            original(self, *args, **kwargs)

        def setattr_(self, name, value):
            # a plain tensor attribute of the Model, first assignment (its place among
            # the parameters: the random numbers it draws come before theirs)
            if (top and self is top[0] and type(value) is torch.Tensor
                    and name not in self._parameters and name not in self._buffers
                    and all(n != name for _, n, _ in registered)):
                registered.append(("tensor", name, value))
            original_setattr(self, name, value)

        torch.nn.Module.__init__ = init
        torch.nn.Module.__setattr__ = setattr_
        hooks = [torch.nn.modules.module.register_module_module_registration_hook(on_module),
                 torch.nn.modules.module.register_module_parameter_registration_hook(
                     on_parameter),
                 torch.nn.modules.module.register_module_buffer_registration_hook(on_buffer)]
        try:
            phase("Model(*get_init_inputs())")
            model = module.Model(*init_inputs)
        finally:
            torch.nn.Module.__init__, torch.nn.Module.__setattr__ = original, original_setattr
            for hook in hooks:
                hook.remove()
        phase("get_inputs()")
        return model, list(module.get_inputs()), init_inputs

    try:
        with torch.device("meta"):
            model, inputs, init_inputs = build()
    except Exception:
        try:
            model, inputs, init_inputs = build()
        except Exception as exc:
            raise LoweringError("task", f"building the task's Model or inputs raised "
                                f"{type(exc).__name__}: {exc}; fix the task") from exc
    if not isinstance(model, torch.nn.Module):
        raise LoweringError("task", "task's Model is not a torch.nn.Module")
    for kind, name, _ in registered:
        value = model.__dict__.get(name) if kind == "tensor" else None
        if isinstance(value, torch.Tensor):  # torch.export refuses a mutated constant
            del model.__dict__[name]
            model.register_buffer(name, value, persistent=False)
    for position, value in enumerate(inputs):
        if not isinstance(value, torch.Tensor | bool | int | float):
            raise LoweringError("inputs", f"get_inputs() item {position} is a "
                                f"{type(value).__name__}; the built-in coder takes tensors "
                                "and numbers only; use the LLM coder")
    return Task(model, tuple(inputs), _forward_arg_names(type(model), len(inputs)),
                init_inputs, list(registered), module, dict(created))


def _forward_arg_names(model_cls: type, count: int) -> list[str]:
    """The task forward's parameter names when they are plain, else ``in0, in1, ...``."""
    fallback = [f"in{i}" for i in range(count)]
    try:
        params = list(inspect.signature(model_cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return fallback
    plain = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in params[:count] if p.kind in plain]
    if (len(names) != count or _RESERVED.intersection(names)
            or any(n.startswith(("buf", "shape", "v_", "_")) for n in names)):
        return fallback
    return names


# Composite operators decomposed further than core ATen, into reductions and
# element-wise operators the schedules below lower (torch._decomp's own decompositions).
_EXTRA_DECOMPOSITIONS = (
    "_softmax", "_log_softmax", "native_layer_norm", "native_group_norm",
    "_native_batch_norm_legit_functional", "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training", "linalg_vector_norm", "logsumexp",
    "std", "mv", "native_dropout",
)


# Composite operators kept whole (core ATen's decompositions would unroll their time
# loop into the graph): the recurrent schedule lowers them (schedules/recurrent.py).
_KEPT_WHOLE = tuple(getattr(torch.ops.aten, name).input
                    for name in ("lstm", "gru", "rnn_tanh", "rnn_relu"))


def _recurrent_fake(cell: str):
    """The shapes of a recurrent operator's results on fake tensors, without running
    its decomposition (a step at a time: seconds a layer under symbolic shapes)."""
    def impl(mode, input, hx, params, has_biases, num_layers, dropout, train,
             bidirectional, batch_first):
        dirs, h0 = 2 if bidirectional else 1, hx[0] if cell == "lstm" else hx
        hidden, (steps, batch) = params[1].shape[1], (
            input.shape[1::-1] if batch_first else input.shape[:2])
        with mode:
            out = input.new_empty((batch, steps, dirs * hidden) if batch_first
                                  else (steps, batch, dirs * hidden))
            states = [h0.new_empty((num_layers * dirs, batch, hidden))
                      for _ in range(2 if cell == "lstm" else 1)]
        return (out, *states)
    return impl


@contextlib.contextmanager
def _fast_recurrent_tracing():
    """While exporting: :data:`_KEPT_WHOLE`'s results on fake tensors from their shapes
    (:func:`_recurrent_fake`), registered for FakeTensorMode and removed after. Where
    torch has its own, or its registration API differs, nothing changes (slower)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    added = []
    try:
        for op in _KEPT_WHOLE:
            table = getattr(op, "python_key_table", None)
            if isinstance(table, dict) and FakeTensorMode not in table:
                op.py_impl(FakeTensorMode)(_recurrent_fake(str(op).split(".")[1]))
                added.append(op)
        yield
    finally:
        for op in added:
            op.python_key_table.pop(FakeTensorMode, None)
            op._dispatch_cache.clear()


@contextlib.contextmanager
def _numbers_made_on_cpu():
    """While exporting: ``torch.tensor(<a Python number>, device=<meta>)`` in forward
    (``torch.tensor(c, device=x.device)``, the inputs being on meta) is made on the CPU,
    so the constant export lifts holds its value (a meta tensor has none). A 0-d CPU
    tensor combines with tensors of any device, so the traced graph is the same."""
    original = torch.tensor

    def tensor(data: Any, **kwargs: Any) -> torch.Tensor:
        device = kwargs.get("device")
        if (isinstance(data, bool | int | float) and device is not None
                and torch.device(device).type == "meta"):
            kwargs["device"] = "cpu"
        return original(data, **kwargs)

    torch.tensor = tensor
    try:
        yield
    finally:
        torch.tensor = original


def scalar_tensors(task: Task) -> tuple[Any, ...] | None:
    """The task's inputs with each number as a 0-d tensor (float32, int64 or bool),
    or None when ``get_inputs()`` returns no number.

    torch.export bakes a Python number argument into the graph as a constant; traced as
    a 0-d tensor it stays a graph input, so the generated kernels take it as an argument
    and ModelNew follows whatever value forward is called with. A 0-d tensor promotes
    like the number it stands for (torch's type promotion treats both as "scalars":
    https://pytorch.org/docs/stable/tensor_attributes.html#type-promotion-doc).
    """
    if all(isinstance(x, torch.Tensor) for x in task.inputs):
        return None
    device = next((x.device for x in task.inputs if isinstance(x, torch.Tensor)), None)
    dtypes = {bool: torch.bool, int: torch.int64, float: torch.float32}
    return tuple(x if isinstance(x, torch.Tensor)
                 else torch.tensor(x, dtype=dtypes[type(x)], device=device)
                 for x in task.inputs)


def export_program(task: Task, inputs: tuple[Any, ...] | None = None) -> torch.export.ExportedProgram:
    """Export with every input extent dynamic (``Dim.AUTO``), else with static shapes.

    Dynamic extents make the graph's view sizes expressions over the inputs' shapes, so
    the generated forward works at other sizes (the worker checks a second one).
    ``inputs`` replaces the task's example inputs (numbers as 0-d tensors).
    """
    from torch._decomp import core_aten_decompositions, get_decompositions

    inputs = task.inputs if inputs is None else inputs
    table = core_aten_decompositions()
    aten = torch.ops.aten
    table.update(get_decompositions([getattr(aten, name) for name in _EXTRA_DECOMPOSITIONS
                                     if hasattr(aten, name)]))
    for op in _KEPT_WHOLE:  # the recurrent schedule's: a time loop, not unrolled
        table.pop(op, None)
    dynamic = tuple({i: torch.export.Dim.AUTO for i in range(x.dim())}
                    if isinstance(x, torch.Tensor) else None for x in inputs)
    errors = []
    for shapes in (dynamic, None):
        # fresh tensors for the static try: the dynamic one leaves its marks on them
        args = inputs if shapes is not None else tuple(
            x.clone() if isinstance(x, torch.Tensor) else x for x in inputs)
        try:
            with warnings.catch_warnings(), _fast_recurrent_tracing(), _numbers_made_on_cpu():
                warnings.simplefilter("ignore")  # torch.export's internal deprecation notices
                ep = torch.export.export(task.model, args, dynamic_shapes=shapes)
                return ep.run_decompositions(table)
        except Exception as exc:  # noqa: BLE001 - retried with static shapes
            errors.append(exc)
    exc = errors[-1]
    # A reference that fails by itself is the task's fault, not something a coder
    # (the LLM's included) can work around: say so instead of blaming the trace.
    try:
        with torch.no_grad():
            task.model(*inputs)
    except Exception as eager:  # noqa: BLE001 - reported as the task's error
        eager_line = (str(eager).strip().splitlines() or [""])[0]
        raise LoweringError("task", f"the task's own Model fails on its get_inputs() "
                            f"({type(eager).__name__}: {eager_line}); fix the task: no "
                            "kernel can match a reference that does not run") from eager
    first_line = (str(exc).strip().splitlines() or [""])[0]
    raise LoweringError("export", f"torch.export could not trace the task's Model "
                        f"({type(exc).__name__}: {first_line}); use the LLM coder") from exc
