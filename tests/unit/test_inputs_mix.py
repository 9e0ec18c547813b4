"""Trial distributions (services/worker/inputs.py): the default three trials reach every
distribution of the schedule, mixed within and across tensors at boundaries drawn from
the trial's seed, with exact zeros, ties and magnitudes up to 1e4 present."""

from __future__ import annotations

import torch

from services.worker import inputs


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_three_trials_reach_every_distribution():
    for large_first in (True, False, None):
        plan = inputs.schedule(3, large_first)
        assert plan[0].name == "task"
        reached = {p for d in plan[1:] for p in d.parts}
        assert reached == {d.name for d in inputs.DISTRIBUTIONS if d.kind != "task"}
    assert inputs.schedule(1) == [inputs.DISTRIBUTIONS[0]]
    # Two trials: one mix of every part.
    assert set(inputs.schedule(2)[1].parts) == set(inputs.LARGE + inputs.SMALL)


def test_a_mix_name_is_parsed_back():
    for dist in inputs.schedule(5, True)[1:]:
        assert inputs.by_name(dist.name) == dist
    assert inputs.by_name("mix: no such part").name == "task"
    assert inputs.by_name("normal x100") == inputs.BY_NAME["normal x100"]


def test_every_part_gets_blocks_in_a_drawn_order():
    cuts = [inputs.blocks(4096, 5, _generator(s)) for s in range(4)]
    for blocks in cuts:
        assert blocks[0][0] == 0 and blocks[-1][1] == 4096
        assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:], strict=False))
        assert sorted(p for *_, p in blocks) == sorted(list(range(5)) * 2)
        # Each block at least half an equal share.
        assert min(stop - start for start, stop, _ in blocks) >= 4096 // 20
    assert len({tuple(b) for b in cuts}) == 4, "order and boundaries come from the seed"
    assert inputs.blocks(4096, 5, _generator(1)) == cuts[1]
    assert inputs.blocks(3, 5, _generator(0))[-1][1] == 3


def test_large_mix_spans_up_to_1e4_and_small_mix_has_zeros_and_ties():
    x = torch.randn(16, 1024, generator=_generator(7))
    large = inputs.reshape(x, inputs.mixed(inputs.LARGE), _generator(1))
    assert large.dtype == x.dtype and large.shape == x.shape
    assert float(large.abs().max()) > 1e4
    assert float(large.abs().min()) < 10
    small = inputs.reshape(x, inputs.mixed(inputs.SMALL), _generator(2))
    assert int((small == 0).sum()) > 100
    values, counts = torch.unique(small[small != 0], return_counts=True)
    assert int(counts.max()) > 10, "ties repeat values"
    assert float(small.abs().max()) <= float(x.abs().max())
    assert float(small[small != 0].abs().min()) < 1e-2
    # Another tensor of the same trial is cut elsewhere.
    g = _generator(3)
    first = inputs.reshape(x, inputs.mixed(inputs.LARGE), g)
    second = inputs.reshape(x, inputs.mixed(inputs.LARGE), g)
    assert not torch.equal(first.abs() > 1000, second.abs() > 1000)


def test_integer_and_bool_inputs_stay():
    idx = torch.arange(10)
    assert inputs.reshape(idx, inputs.mixed(inputs.LARGE), _generator(0)) is idx


def test_fallbacks_leave_out_the_largest_parts_first():
    dist = inputs.mixed(inputs.LARGE)
    tries = inputs.attempts(dist)
    assert tries[0] == (dist, False) and tries[1] == (dist, True)
    assert [inputs.left_out(dist, d) for d, _ in tries[2:]] == [
        ["normal x10000"], ["normal x10000", "normal x100"],
        ["normal x10000", "normal x100", "uniform +-10"]]
    small = inputs.mixed(inputs.SMALL)
    assert [inputs.left_out(small, d) for d, _ in inputs.attempts(small)[2:]] == [
        ["zeros"], ["negative", "zeros"]]
