"""``ModelNew.__init__``: the task Model's parameters declared again, in the same order.

Known parameterised modules (``nn.Linear``, the batch/instance/layer/group norms,
``nn.Conv*d``, ``nn.ConvTranspose*d``, ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` and
``nn.MultiheadAttention``) are
constructed again from their attributes; containers (``nn.Sequential``,
``nn.ModuleList``) and other modules holding parameters become plain ``nn.Module``s
with the same attribute names, so a parameter's qualified name (``features.0.weight``)
is the same in ModelNew (:func:`attr_path`); each ``nn.Parameter`` is created with
the function (``torch.randn``, ``rand``, ``zeros``, ``ones`` or its fixed values) that,
from the same seed, gives the Model's values; modules and parameters are created in the
order the Model created them. Sizes follow the init arguments they derive from
(:mod:`.init_args`), so ModelNew built at another size follows. Anything else raises
:class:`LoweringError` tagged ``parameters``.
"""

from __future__ import annotations

import itertools
import keyword
from typing import Any

import torch

from services.generator.lowering.errors import LoweringError
from services.generator.lowering.init_args import follow_init_args
from services.generator.lowering.task import Task


class _Args:
    """Renders a constructor argument as ``args[i]`` when it is ModelNew's i-th init
    argument, so ModelNew built with other init arguments (another size) follows them."""

    def __init__(self, init_inputs: list[Any]) -> None:
        self.init_inputs = init_inputs

    def __call__(self, value: Any) -> str:
        for i, arg in enumerate(self.init_inputs):
            if type(arg) is bool or type(value) is bool:
                continue
            if isinstance(value, int) and type(arg) is int and arg == value:
                return f"args[{i}]"
            if (isinstance(value, tuple | list) and isinstance(arg, tuple | list)
                    and tuple(arg) == tuple(value)):
                return f"tuple(args[{i}])"
        if isinstance(value, int) and type(value) is not bool:
            # an element of a list argument (an MLP's ``layer_sizes``)
            for i, arg in enumerate(self.init_inputs):
                if isinstance(arg, tuple | list):
                    for j, item in enumerate(arg):
                        if type(item) is int and item == value:
                            return f"args[{i}][{j}]"
        if isinstance(value, tuple | list):
            return "(" + "".join(f"{self(v)}, " for v in value) + ")"
        return repr(value)


# Known parameterised modules and how to construct them again from their attributes.
def _module_ctor(module: torch.nn.Module, a: _Args) -> str | None:
    nn = torch.nn
    if type(module) is nn.Linear:
        return (f"nn.Linear({a(module.in_features)}, {a(module.out_features)}, "
                f"bias={module.bias is not None})")
    if type(module) in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.InstanceNorm1d,
                        nn.InstanceNorm2d, nn.InstanceNorm3d):
        return (f"nn.{type(module).__name__}({a(module.num_features)}, eps={module.eps}, "
                f"momentum={module.momentum}, affine={module.affine}, "
                f"track_running_stats={module.track_running_stats})")
    if type(module) is nn.LayerNorm:
        return (f"nn.LayerNorm({a(tuple(module.normalized_shape))}, eps={module.eps}, "
                f"elementwise_affine={module.elementwise_affine}, bias={module.bias is not None})")
    if type(module) is nn.GroupNorm:
        return (f"nn.GroupNorm({a(module.num_groups)}, {a(module.num_channels)}, "
                f"eps={module.eps}, affine={module.affine})")
    if type(module) in _CONVS:
        return _conv_ctor(module, a)
    if type(module) in (nn.LSTM, nn.GRU, nn.RNN):
        extra = f", nonlinearity={module.nonlinearity!r}" if type(module) is nn.RNN else ""
        extra += f", proj_size={a(module.proj_size)}" if getattr(module, "proj_size", 0) else ""
        return (f"nn.{type(module).__name__}({a(module.input_size)}, {a(module.hidden_size)}, "
                f"num_layers={a(module.num_layers)}, bias={module.bias}, "
                f"batch_first={module.batch_first}, dropout={module.dropout}, "
                f"bidirectional={module.bidirectional}{extra})")
    if type(module) is nn.MultiheadAttention:
        return (f"nn.MultiheadAttention({a(module.embed_dim)}, {a(module.num_heads)}, "
                f"dropout={module.dropout}, bias={module.in_proj_bias is not None}, "
                f"add_bias_kv={module.bias_k is not None}, "
                f"add_zero_attn={module.add_zero_attn}, kdim={a(module.kdim)}, "
                f"vdim={a(module.vdim)}, batch_first={module.batch_first})")
    return None


def attr(owner: str, name: str) -> str:
    """The expression for ``owner``'s attribute ``name`` (``self.fc``; a container's
    numbered child ``getattr(self.layers, '0')``)."""
    if name.isidentifier() and not keyword.iskeyword(name):
        return f"{owner}.{name}"
    return f"getattr({owner}, {name!r})"


def attr_path(owner: str, dotted: str) -> str:
    """``owner``'s attribute at the dotted path ``dotted`` (a parameter's or buffer's
    fully qualified name, ``features.0.weight``) as a Python expression."""
    for name in dotted.split("."):
        owner = attr(owner, name)
    return owner


# One declaration: (the attribute's path, its line, the creation index of its first
# parameter or None for a container, the line holding its place until it is created).
_Decl = tuple[str, str, "int | None", str]


def _declare(owner: str, name: str, module: torch.nn.Module, a: Any,
             created: dict[int, int]) -> list[_Decl]:
    """Declarations of ``module`` again as ``owner``'s attribute ``name``: a known
    module by its constructor; a container (``nn.Sequential``, ``nn.ModuleList``) or
    another module holding parameters as a plain ``nn.Module`` with the same attribute
    names, its own parameters (``torch.randn`` of their shape, matched later) before its
    children, in registration order; nothing for a module without parameters or buffers
    (activations, dropout, pooling). Sizes are rendered by ``a``; ``created`` gives
    each parameter's creation index (:attr:`Task.created`).

    Raises:
        LoweringError: (``parameters``) a module of another kind holds buffers.
    """
    path = attr(owner, name)

    def assign(value: str) -> str:
        if name.isidentifier() and not keyword.iskeyword(name):
            return f"{owner}.{name} = {value}"
        return f"setattr({owner}, {name!r}, {value})"

    ctor = _module_ctor(module, a)
    if ctor is not None:
        order = min((created.get(id(p), -1) for p in module.parameters()), default=None)
        return [(path, assign(ctor), order, assign("nn.Module()"))]
    if not any(True for _ in module.parameters()) and not any(True for _ in module.buffers()):
        return []
    if any(not n.isidentifier() or keyword.iskeyword(n) for n in module._parameters):
        raise LoweringError("parameters", f"the task's Model holds a {type(module).__name__} "
                            "with parameters the built-in coder cannot declare again; use "
                            "the LLM coder")
    lines: list[_Decl] = [(path, assign("nn.Module()"), None, "")]
    for bname, value in module._buffers.items():
        if value is not None:
            lines.append(_buffer(module, path, bname, value, a))
    for pname, value in module._parameters.items():
        if value is not None:
            lines.append((f"{path}.{pname}", f"{path}.{pname} = "
                          f"nn.Parameter(torch.randn({a(tuple(value.shape))}))",
                          created.get(id(value), -1),
                          f"{path}.register_parameter({pname!r}, None)"))
    for cname, child in module._modules.items():
        if child is not None:
            lines += _declare(path, cname, child, a, created)
    return lines


def _buffer(owner_module: torch.nn.Module, owner: str, name: str, value: torch.Tensor,
            a: Any) -> _Decl:
    """A buffer of a container or the task's own module declared again: only a causal
    mask, ``torch.tril(torch.ones(n, n))`` viewed as ``(1, ..., 1, n, n)`` (GPT-style
    attention), whose values are checked with the parameters'.

    Raises:
        LoweringError: (``parameters``) a buffer of any other shape or dtype.
    """
    shape = tuple(value.shape)
    if (len(shape) < 2 or shape[-1] != shape[-2] or any(s != 1 for s in shape[:-2])
            or value.dtype != torch.float32 or not name.isidentifier()):
        raise LoweringError("parameters", f"the task's Model holds a buffer `{name}` of shape "
                            f"{list(shape)} the built-in coder cannot declare again (only a "
                            "causal mask, tril(ones(n, n))); use the LLM coder")
    n = a(shape[-1])
    persistent = name not in owner_module._non_persistent_buffers_set
    return (f"{owner}.{name}", f"{owner}.register_buffer({name!r}, torch.tril(torch.ones("
            f"{n}, {n})).view({a(shape)}), persistent={persistent})", None, "")


def _raw(value: Any) -> str:
    """Sizes as plain numbers (what :func:`.init_args.follow_init_args` compares)."""
    if isinstance(value, tuple | list):
        return "(" + "".join(f"{_raw(v)}, " for v in value) + ")"
    return repr(value)


def _declarations(task: Task, model: torch.nn.Module, a: Any) -> list[_Decl]:
    """Declarations of the Model's attributes in ``task.registered``, looked up by name
    on ``model`` (the task's Model or one built at other sizes)."""
    created = task.created if model is task.model else {}
    lines: list[_Decl] = []
    for kind, name, _ in task.registered:
        value = getattr(model, name)
        if kind == "module":
            lines += _declare("self", name, value, a, created)
        elif kind == "buffer":
            lines.append(_buffer(model, "self", name, value, a))
        elif kind == "tensor":
            if value.dtype != torch.float32:
                raise LoweringError("parameters", f"the task's Model holds a tensor `{name}` "
                                    f"of dtype {value.dtype} the built-in coder cannot "
                                    "create again (only torch.randn); use the LLM coder")
            lines.append((f"self.{name}", f"self.register_buffer({name!r}, torch.randn("
                          f"{a(tuple(value.shape))}), persistent=False)", None, ""))
        else:
            lines.append((f"self.{name}",
                          f"self.{name} = nn.Parameter(torch.randn({a(tuple(value.shape))}))",
                          created.get(id(value), -1),
                          f"self.register_parameter({name!r}, None)"))
    return lines


def _in_creation_order(decls: list[_Decl], lines: list[str]) -> list[str]:
    """``lines`` (one per declaration) reordered so that modules and parameters are
    created in the order the Model created them (seeded values then match): when that
    is not the declaration order, every container and a placeholder for every module
    and parameter come first, in declaration order (so names keep their order), then
    the modules and parameters in creation order, each replacing its placeholder."""
    orders = [d[2] for d in decls if d[2] is not None]
    if orders == sorted(orders):
        return lines
    first = [line if d[2] is None else d[3] for d, line in zip(decls, lines, strict=True)]
    later = sorted((d[2], k) for k, d in enumerate(decls) if d[2] is not None)
    return first + [lines[k] for _, k in later]


_CONVS = tuple(getattr(torch.nn, f"Conv{t}{d}d") for t in ("", "Transpose") for d in (1, 2, 3))


def _conv_ctor(module: torch.nn.Module, a: _Args) -> str:
    """``nn.Conv*d`` / ``nn.ConvTranspose*d`` again. Channel counts follow the init
    arguments; the window (kernel_size, stride, padding, dilation) is written as it is,
    since an init argument that equals it by chance (``in_channels = kernel_size = 3``)
    would make it follow a size; groups follows in_channels when it equals it
    (depthwise)."""
    groups = (a(module.in_channels) if module.groups == module.in_channels != 1
              else a(module.groups))
    window = (f"{tuple(module.kernel_size)!r}, stride={tuple(module.stride)!r}, "
              f"padding={module.padding!r}, dilation={tuple(module.dilation)!r}")
    extra = (f", output_padding={tuple(module.output_padding)!r}"
             if isinstance(module, torch.nn.modules.conv._ConvTransposeNd) else "")
    return (f"nn.{type(module).__name__}({a(module.in_channels)}, {a(module.out_channels)}, "
            f"{window}{extra}, groups={groups}, bias={module.bias is not None}, "
            f"padding_mode={module.padding_mode!r})")


def init_lines(task: Task) -> list[str]:
    """ModelNew.__init__ lines declaring the Model's parameters in the same order.

    Each direct parameter is created as the task does, with ``torch.randn`` (the usual
    KernelBench spelling), ``torch.rand``, ``torch.zeros``, ``torch.ones`` of its shape or
    its fixed values; which one is checked by building both models from the same seed.
    Sizes follow the init arguments (:func:`.init_args.follow_init_args`); where
    they cannot be fitted, sizes equal to an init argument are read from ``args``.
    """
    decls = _declarations(task, task.model, _Args(task.init_inputs))
    if not decls:
        return []
    lines = follow_init_args(task, lambda model: [d[:2] for d in _declarations(task, model, _raw)],
                             [d[:2] for d in decls])
    return _match_parameters(task, _in_creation_order(decls, lines))


def _match_parameters(task: Task, lines: list[str]) -> list[str]:
    """Pick the creating function of each direct parameter so that seeded construction
    gives the Model's values; refuse when none does."""
    try:
        torch.manual_seed(0)
        reference = task.module.Model(*task.module.get_init_inputs())
    except Exception as exc:  # noqa: BLE001 - the task does not build on CPU
        raise LoweringError("parameters", f"building the task's Model on CPU raised "
                            f"{type(exc).__name__}: {exc}") from exc
    state = reference.state_dict()
    expected = [t.detach() for t in state.values()]
    # plain tensor attributes (``self.hidden = torch.randn(...)``): non-persistent buffers
    plain = [name for kind, name, _ in task.registered if kind == "tensor"]
    expected += [getattr(reference, name) for name in plain]
    choices = ["randn", "rand", "zeros", "ones", "literal"]
    param_lines = [k for k, line in enumerate(lines) if "nn.Parameter(torch.randn" in line]
    for combo in itertools.islice(itertools.product(choices, repeat=len(param_lines)), 256):
        trial = list(lines)
        for k, fn in zip(param_lines, combo, strict=True):
            if fn == "literal":
                # a parameter the task fills with fixed values, e.g. torch.tensor(constant)
                name = trial[k].split("=")[0].strip().removeprefix("self.")
                value = state.get(name)
                if value is None or value.numel() > 64:
                    break
                trial[k] = (f"self.{name} = nn.Parameter(torch.tensor({value.tolist()!r}, "
                            f"dtype={value.dtype}))")
            else:
                trial[k] = trial[k].replace("torch.randn(", f"torch.{fn}(")
        holder = torch.nn.Module()
        scope = {"torch": torch, "nn": torch.nn, "self": holder, "args": task.init_inputs}
        torch.manual_seed(0)
        exec("\n".join(trial), scope)
        got = [t.detach() for t in holder.state_dict().values()]
        got += [getattr(holder, name) for name in plain]
        if len(got) == len(expected) and all(
                g.shape == e.shape and torch.equal(g, e) for g, e in zip(got, expected, strict=True)):
            return trial
    raise LoweringError("parameters", "the task's Model initialises its parameters in a way "
                        "the built-in coder cannot reproduce from the same seed; use the LLM "
                        "coder")
