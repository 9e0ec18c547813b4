"""What one verification holds about its sizes and calls, and how their frames decode.

:class:`CheckedSize` is one set of sizes the procedure runs (the requested ones, the
task's own or a congruent one, the shape-generality one); :class:`Trial` is one call
of ``forward`` at such a size, with what the reference made for it and what the
planner traced. The rules that pick sizes are :mod:`services.worker.sizes`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from services.sandbox import wire
from services.worker.children import decode_tensor


@dataclass
class Trial:
    """What the reference made for one input set, and what came of it: ``key`` names
    the size (``main``, ``declared``, ``second``, ``generic``), ``index`` the trial or
    declared shape, ``model`` the built ModelNew it runs on."""

    key: str
    index: int
    model: str
    real: tuple[Any, list[bytearray]] | None = None
    decoy: tuple[Any, list[bytearray]] | None = None
    traced: tuple[Any, list[bytearray]] | None = None


@dataclass
class CheckedSize:
    """One set of sizes checked: the task's module-level names rebound
    (``overrides``), the resulting size names, its input bytes and the reference's
    ``get_init_inputs()`` (frame and raw buffers)."""

    key: str
    overrides: dict[str, Any]
    names: dict[str, Any] = field(default_factory=dict)
    input_bytes: int = 0
    init: tuple[Any, list[bytearray]] | None = None


def outputs_of(frame: Any, raws: list[bytearray], skip: int = 0) -> list[torch.Tensor]:
    """The output tensors of a reference trial, a replay or a traced call; ``skip``
    raw buffers (the inputs' or captures') come first."""
    metas = frame.outputs if isinstance(frame, (wire.RefTrial, wire.Replayed)) else \
        frame.output_metas
    return [decode_tensor(m, raws[skip + i]) for i, m in enumerate(metas)]


def constant(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is equal (an empty tensor is)."""
    flat = t.reshape(-1)
    return flat.numel() == 0 or bool((flat == flat[0]).all())


def format_bytes(n: float) -> str:
    """``n`` bytes as GiB, MiB or KiB with one decimal."""
    if n >= 1 << 30:
        return f"{n / (1 << 30):.1f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / 1024:.1f} KiB"
