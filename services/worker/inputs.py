"""Trial inputs: secret seeds, the distributions they are drawn from, and decoys.

Every verification draws its seeds from the operating system's cryptographic source
(:func:`draw_seeds`); only the reference child (which runs the task's code, never the
candidate's) sees them. For each trial it calls the task's ``get_inputs()`` under the
seed and then reshapes the floating-point tensors as :func:`schedule` says, as
KernelBench's newer harness varies its inputs:

* trial 0 keeps the task's own inputs;
* every other trial is a *mix* (:func:`mix`): each floating tensor is cut into blocks
  of elements, each block redrawn from one of the mix's parts, in an order and at
  boundaries drawn from the trial's seed, another cut for every tensor. With two or
  more mixed trials the parts are split by magnitude: :data:`LARGE` (normal x10000,
  x100, x10, uniform +-10) and :data:`SMALL` (normal x0.001, x0.1, one sign, exact
  zeros, ties), which one comes first drawn by the worker from ``secrets``; a single
  mixed trial (``trials=2``) mixes them all. So the default three trials reach every
  distribution of :data:`DISTRIBUTIONS`, and magnitudes up to 1e4.

Magnitudes are split because the comparison is scale-aware
(:mod:`services.worker.correctness`): ``atol`` grows with the root-mean-square of the
expected output, so a block of 1e-3 values beside a block of 1e4 values would be held
to the large block's ``atol``.

A mix that makes the task's ``Model`` produce NaN or Inf where the task's own inputs do
not is outside the task's domain; :func:`attempts` gives the fall-backs in order: the
same parts with signs kept (magnitudes only), then without its largest part, and so
on (the verdict's note says which parts were left out), and last the task's own.
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
MIX_PREFIX = "mix: "
# Each part of a mix gets this many blocks of a tensor (in an order drawn per tensor).
BLOCKS_PER_PART = 2


@dataclass(frozen=True)
class Distribution:
    """How a trial reshapes the task's floating-point inputs.

    ``kind``: ``task`` (as made), ``normal`` (standard normal times ``scale``),
    ``uniform`` (in ``[-scale, scale)``), ``negative`` / ``positive`` (one sign, the
    task's magnitudes times ``scale``), ``zeros`` (a quarter of the elements exactly
    zero), ``ties`` (values rounded to a few levels, so maxima and minima repeat),
    ``mix`` (blocks of elements from each of ``parts``, names of other distributions;
    :func:`mix`).
    """

    name: str
    kind: str
    scale: float = 1.0
    parts: tuple[str, ...] = ()


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
    Distribution("normal x10000", "normal", 1e4),
)
BY_NAME = {d.name: d for d in DISTRIBUTIONS}
# The two halves of the non-task distributions, by magnitude (see the module doc).
LARGE: tuple[str, ...] = ("normal x10000", "normal x100", "uniform +-10", "normal x10")
SMALL: tuple[str, ...] = ("normal x0.001", "normal x0.1", "negative", "zeros", "ties")
# Parts a fall-back leaves out first: the largest magnitudes, then exact zeros (a
# logarithm's or a division's pole), then one sign.
_DROP_ORDER = ("normal x10000", "normal x100", "uniform +-10", "normal x10", "zeros",
               "negative")


def mixed(parts: tuple[str, ...] | list[str]) -> Distribution:
    """The mix of ``parts`` (names in :data:`BY_NAME`), named ``mix: a, b, ...``."""
    return Distribution(MIX_PREFIX + ", ".join(parts), "mix", parts=tuple(parts))


def by_name(name: str) -> Distribution:
    """The distribution a :func:`schedule` name stands for (a mix's parts parsed back);
    the task's own for a name it does not know."""
    if name.startswith(MIX_PREFIX):
        parts = tuple(p for p in name.removeprefix(MIX_PREFIX).split(", ") if p in BY_NAME
                      and BY_NAME[p].kind not in ("task", "mix"))
        return mixed(parts) if parts else DISTRIBUTIONS[0]
    return BY_NAME.get(name, DISTRIBUTIONS[0])


def draw_seeds(n: int) -> list[int]:
    """``n`` distinct seeds from the OS's cryptographic source (``secrets``)."""
    seeds: set[int] = set()
    while len(seeds) < n:
        seeds.add(secrets.randbits(_SEED_BITS))
    return list(seeds)


def schedule(trials: int, large_first: bool | None = None) -> list[Distribution]:
    """The distribution of each trial: the task's own first, then mixes (module doc).

    ``large_first``: whether the first mixed trial takes :data:`LARGE`; None draws it
    from ``secrets``. Later mixed trials alternate between the two halves.
    """
    if large_first is None:
        large_first = bool(secrets.randbits(1))
    out = [DISTRIBUTIONS[0]] if trials > 0 else []
    if trials == 2:
        return out + [mixed(LARGE + SMALL)]
    halves = (LARGE, SMALL) if large_first else (SMALL, LARGE)
    return out + [mixed(halves[i % 2]) for i in range(max(trials - 1, 0))]


def attempts(dist: Distribution) -> list[tuple[Distribution, bool]]:
    """What a trial drawn from ``dist`` tries, in order, until the task's ``Model`` gives
    finite outputs: ``(distribution, keep_signs)`` pairs (see the module doc); the
    task's own comes after the last."""
    if dist.kind == "task":
        return [(dist, False)]
    if dist.kind != "mix":
        return [(dist, False), (dist, True)]
    out = [(dist, False), (dist, True)]
    parts = list(dist.parts)
    for name in _DROP_ORDER:
        if name in parts and len(parts) > 1:
            parts.remove(name)
            out.append((mixed(parts), True))
    return out


def left_out(dist: Distribution, used: Distribution) -> list[str]:
    """The parts of mix ``dist`` that ``used`` (one of its :func:`attempts`) left out."""
    return [p for p in dist.parts if p not in used.parts]


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
    if dist.kind == "mix":
        return mix(value, dist, generator, keep_signs)
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


def blocks(n: int, parts: int, generator: torch.Generator) -> list[tuple[int, int, int]]:
    """Cut ``n`` elements into ``BLOCKS_PER_PART * parts`` contiguous blocks:
    ``(start, stop, part index)``, every part :data:`BLOCKS_PER_PART` times in an order
    drawn from ``generator``; each block holds at least half an equal share, the rest
    of the boundaries drawn from ``generator`` too. Empty blocks are left out (``n``
    below the number of blocks)."""
    count = BLOCKS_PER_PART * parts
    order = [int(i) % parts for i in torch.randperm(count, generator=generator)]
    base = n // (2 * count)
    spare = n - base * count
    cuts = sorted(int(c) for c in torch.randint(0, spare + 1, (count - 1,),
                                                generator=generator))
    edges = [0, *cuts, spare]
    out, start = [], 0
    for i, part in enumerate(order):
        stop = start + base + edges[i + 1] - edges[i]
        if stop > start:
            out.append((start, stop, part))
        start = stop
    return out


def mix(value: torch.Tensor, dist: Distribution, generator: torch.Generator,
        keep_signs: bool = False) -> torch.Tensor:
    """``value`` (a floating tensor the task made, any shape) with each block of its
    elements (in memory order, :func:`blocks`) redrawn from one of ``dist.parts``."""
    parts = [BY_NAME[p] for p in dist.parts]
    flat = value.detach().reshape(-1)
    out = torch.empty_like(flat)
    for start, stop, part in blocks(flat.numel(), len(parts), generator):
        out[start:stop] = reshape(flat[start:stop], parts[part], generator, keep_signs)
    return out.reshape(value.shape).contiguous()


def nonfinite(outputs: list[torch.Tensor]) -> bool:
    """Whether any floating output holds NaN or Inf."""
    return any((t.dtype.is_floating_point or t.dtype.is_complex) and t.numel()
               and not bool(torch.isfinite(t).all()) for t in outputs)
