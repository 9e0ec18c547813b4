"""A static look at a task's source: what the built-in coder surely declines, found
without running the task (no torch import, no sandbox, microseconds).

The built-in coder lowers a task by running it in a sandboxed child and exporting its
graph, which costs a fork server start (seconds) the first time. A task whose ``Model``
builds a module or calls a function that lowers to an operator with no schedule
(:mod:`services.generator.lowering`) is declined here instead, with the same
message the lowering would give: the operator, its family, and that the LLM coder can
take it. Anything not listed goes to the lowering, which has the last word.
"""

from __future__ import annotations

import ast

from services.common.pyast import parse

__all__ = ["decline"]

# nn modules the built-in coder cannot declare again or lower (its parameterised modules
# are Linear, the norms, the convolutions and LSTM / GRU / RNN), with the core-ATen operator each one's
# forward becomes (torch.nn.modules source; aten/src/ATen/native/native_functions.yaml).
# Lazy convolutions hold uninitialized parameters until their first forward: nothing
# to declare again.
_MODULES: dict[str, tuple[str, str]] = {
    **{f"LazyConv{n}d": ("aten.convolution.default", "convolution") for n in (1, 2, 3)},
    "Embedding": ("aten.embedding.default", "indexing"),
    "EmbeddingBag": ("aten._embedding_bag.default", "indexing"),
    "MultiheadAttention": ("aten._native_multi_head_attention.default", "attention"),
    "Transformer": ("aten._transformer_encoder_layer_fwd.default", "attention"),
    "TransformerEncoderLayer": ("aten._transformer_encoder_layer_fwd.default", "attention"),
    "TransformerDecoderLayer": ("aten._native_multi_head_attention.default", "attention"),
}
# torch.nn.functional / torch functions of the same operators.
_FUNCTIONS: dict[str, tuple[str, str]] = {
    "embedding": ("aten.embedding.default", "indexing"),
    "unfold": ("aten.im2col.default", "convolution"),
    "fold": ("aten.col2im.default", "convolution"),
}


def _attribute_path(node: ast.expr) -> list[str]:
    """``torch.nn.functional.conv2d`` -> ``["torch", "nn", "functional", "conv2d"]``."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return parts[::-1]


def decline(task_desc: str) -> str | None:
    """Why the built-in coder cannot lower ``task_desc``, when that shows in its source.

    Looks only inside ``class Model``: a call ``nn.<Module>(...)`` (or ``torch.nn.``)
    of a module in :data:`_MODULES`, or ``F.<fn>(...)`` / ``torch.<fn>(...)`` /
    ``torch.nn.functional.<fn>(...)`` of a function in :data:`_FUNCTIONS`.

    Returns:
        The refusal (``built-in coder cannot lower aten.embedding.default
        (indexing: nn.Embedding in Model; ...); use the LLM coder``), or None when
        nothing here is surely declined (the lowering decides). None too for source
        that does not parse: the lowering reports that with its line number.
    """
    try:
        tree = parse(task_desc)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    model = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Model"),
                 None)
    if model is None:
        return None
    for node in ast.walk(model):
        if not isinstance(node, ast.Call):
            continue
        path = _attribute_path(node.func)
        if len(path) < 2:
            continue
        name, owner = path[-1], path[:-1]
        found = None
        if owner in (["nn"], ["torch", "nn"]) and name in _MODULES:
            found, spelled = _MODULES[name], f"nn.{name}"
        elif owner in (["F"], ["torch"], ["nn", "functional"], ["torch", "nn", "functional"]) \
                and name in _FUNCTIONS:
            found, spelled = _FUNCTIONS[name], f"{'.'.join(owner)}.{name}"
        if found is not None:
            op, family = found
            return (f"built-in coder cannot lower {op} ({family} operators have no schedule "
                    f"here: {spelled} on line {node.lineno} of the task's Model); use the "
                    "LLM coder")
    return None
