"""Trial inputs: secret seeds, the distributions they are drawn from, and decoys.

Every verification draws its seeds from the operating system's cryptographic source
(:func:`draw_seeds`); only the reference child (which runs the task's code, never the
candidate's) sees them. For each trial it calls the task's ``get_inputs()`` under the
seed and then reshapes the floating-point tensors to one of :data:`DISTRIBUTIONS`,
in the order :func:`schedule` gives: the task's own first, then large and small
magnitudes, uniform, one sign, zeros and ties, as KernelBench's newer harness varies
its inputs. A distribution that makes the task's ``Model`` produce NaN or Inf where
the task's own inputs do not is outside the task's domain; the trial then falls back
to a domain-preserving version (magnitudes only, signs kept), then to the task's own.
Integer and bool tensors (indices, masks) are left as the task made them.

The candidate's process gets *decoys*: the task's own inputs at other secret seeds,
of the same shapes and dtypes. It plans its kernel launches on them; the replayer runs
the plan on the real inputs.

Weights stay KernelBench-compatible: ``Model`` and ``ModelNew`` are built under the
same :data:`INIT_SEED`, which no trial input depends on.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

# torch.manual_seed before get_init_inputs() and each model's constructor (KernelBench
# builds Model and ModelNew under one seed so that their parameters agree).
INIT_SEED = 42
# Seeds are drawn below 2**62 (torch.manual_seed takes any 64-bit value).
_SEED_BITS = 62


@dataclass(frozen=True)
class Distribution:
    """How a trial reshapes the task's floating-point inputs.

    ``kind``: ``task`` (as made), ``normal`` (standard normal times ``scale``),
    ``uniform`` (in ``[-scale, scale)``), ``negative`` / ``positive`` (one sign, the
    task's magnitudes times ``scale``), ``zeros`` (a quarter of the elements exactly
    zero), ``ties`` (values rounded to a few levels, so maxima and minima repeat).
    """

    name: str
    kind: str
    scale: float = 1.0


DISTRIBUTIONS: tuple[Distribution, ...] = (
    Distribution("task", "task"),
    Distribution("normal x100", "normal", 100.0),
    Distribution("normal x0.001", "normal", 1e-3),
    Distribution("uniform +-10", "uniform", 10.0),
    Distribution("negative", "negative"),
    Distribution("zeros", "zeros"),
    Distribution("ties", "ties"),
    Distribution("normal x10", "normal", 10.0),
    Distribution("normal x0.1", "normal", 0.1),
)
BY_NAME = {d.name: d for d in DISTRIBUTIONS}


def draw_seeds(n: int) -> list[int]:
    """``n`` distinct seeds from the OS's cryptographic source (``secrets``)."""
    seeds: set[int] = set()
    while len(seeds) < n:
        seeds.add(secrets.randbits(_SEED_BITS))
    return list(seeds)


def schedule(trials: int) -> list[Distribution]:
    """The distribution of each trial: the task's own first, then the others in order
    (cycling past their number)."""
    return [DISTRIBUTIONS[i % len(DISTRIBUTIONS)] for i in range(trials)]


def reshape(value: torch.Tensor, dist: Distribution, generator: torch.Generator,
            keep_signs: bool = False) -> torch.Tensor:
    """``value`` (a floating tensor the task made) redrawn from ``dist``.

    ``keep_signs``: only magnitudes change (a task whose inputs must keep a sign, e.g.
    logarithms of positive values): ``normal`` / ``uniform`` scale the task's own
    values, one-signed kinds keep them.
    """
    if not (value.dtype.is_floating_point or value.dtype.is_complex) or dist.kind == "task" \
            or value.numel() == 0:
        return value
    work = value.detach().to(torch.float64) if not value.dtype.is_complex else value.detach()
    if dist.kind in ("normal", "uniform") and keep_signs:
        out = work * dist.scale
    elif dist.kind == "normal":
        out = torch.randn(work.shape, generator=generator, dtype=work.dtype) * dist.scale
    elif dist.kind == "uniform":
        out = (torch.rand(work.shape, generator=generator, dtype=work.dtype) * 2 - 1) * dist.scale
    elif dist.kind == "negative":
        out = work if keep_signs else -work.abs()
    elif dist.kind == "positive":
        out = work.abs()
    elif dist.kind == "zeros":
        keep = torch.rand(work.shape, generator=generator) >= 0.25
        out = torch.where(keep, work, torch.zeros((), dtype=work.dtype))
    elif dist.kind == "ties":
        spread = float(work.abs().max()) or 1.0
        out = torch.round(work / spread * 4) / 4 * spread
    else:
        raise ValueError(f"unknown distribution kind {dist.kind!r}")
    return out.to(value.dtype).contiguous()


def nonfinite(outputs: list[torch.Tensor]) -> bool:
    """Whether any floating output holds NaN or Inf."""
    return any((t.dtype.is_floating_point or t.dtype.is_complex) and t.numel()
               and not bool(torch.isfinite(t).all()) for t in outputs)
