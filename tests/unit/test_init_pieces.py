"""Rule D030's constant pieces: a storage joined from fills of more than one value is a
table made on the host (computed), one fill value throughout stays clean, and a value of
the init's tensors read into Python makes later fills computed. The recorder runs here
in process on real torch operators (services/worker/init_compute.py)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from services.worker.init_compute import ITEM_SEEDED, JOINED, InitRecorder, piece


def _labels(build) -> set[str]:
    recorder = InitRecorder()
    with recorder:
        t = build()
    return recorder.labels_of(t)


def test_fills_of_different_values_joined_are_computed():
    assert _labels(lambda: torch.cat([torch.full((1,), math.exp(i / 8)) for i in range(8)])) \
        == {JOINED}
    assert _labels(lambda: torch.stack([torch.full((2,), float(i)) for i in range(4)])) \
        == {JOINED}
    assert _labels(lambda: torch.cat([torch.arange(i, i + 1) for i in range(4)])) == {JOINED}
    assert _labels(lambda: F.pad(torch.full((2,), 3.0), (0, 2), value=4.0)) == {JOINED}


def test_fills_written_into_parts_of_one_buffer_are_computed():
    def parts():
        b = torch.empty(4)
        b[0:2].copy_(torch.full((2,), 1.0))
        b[2:4].fill_(2.0)
        return b
    assert _labels(parts) == {JOINED}


def test_random_fills_too_narrow_to_be_random_are_constants():
    assert _labels(lambda: torch.cat([torch.empty(1).uniform_(v, v) for v in (1.0, 2.0)])) \
        == {JOINED}
    assert _labels(lambda: torch.cat([torch.randint(i, i + 1, (1,)) for i in range(3)])) \
        == {JOINED}
    assert _labels(lambda: torch.cat([torch.empty(1).normal_(v, 0.0) for v in (1.0, 2.0)])) \
        == {JOINED}
    assert piece("uniform_", {"from": -0.1, "to": 0.1}) == (None, True)
    assert piece("uniform_", {"from": 2.5, "to": 2.5}) == ("2.5", False)
    assert piece("normal_", {"mean": 0.0, "std": 0.02}) == (None, True)


def test_one_fill_value_and_seeded_weights_stay_clean():
    linear = torch.nn.Linear(8, 8)
    assert _labels(lambda: torch.ones(8)) == set()
    assert _labels(lambda: torch.cat([torch.ones(4), torch.ones(4)])) == set()
    assert _labels(lambda: torch.cat([torch.nn.Linear(8, 8).bias, torch.zeros(8)])) == set()
    assert _labels(lambda: F.pad(torch.nn.Linear(8, 8).weight, (0, 8))) == set()
    assert _labels(lambda: torch.zeros(8).fill_(2.0)) == set()
    assert _labels(lambda: torch.zeros(4).copy_(torch.ones(4))) == set()
    assert _labels(lambda: torch.cat([linear.weight.detach(), linear.weight.detach()])) \
        == {"no recorded operator (made outside torch's operators)"}  # made before recording


def test_a_fill_from_a_value_of_the_init_tensors_is_computed():
    def from_weight():
        w = torch.nn.Linear(4, 4).weight
        return torch.full((4,), w[0, 0].item() * 2)
    assert _labels(from_weight) == {ITEM_SEEDED}
