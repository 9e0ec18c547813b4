"""Evolve on the cpu backend ranks candidates by the tile model where a verdict has it."""

from __future__ import annotations

from schemas import EvolveCandidate
from schemas.events import Traffic
from services.generator.evolve import fitness_key, modeled_fitness


def _traffic(**fields) -> Traffic:
    return Traffic(bytes_moved=1, bytes_min=1, **fields)


def test_the_tile_model_decides_where_present_else_the_roofline():
    assert modeled_fitness(_traffic(tile_time_us=5.0, tile_speedup=2.0,
                                    modeled_time_us=1.0, modeled_speedup=9.0)) == (5.0, 2.0)
    assert modeled_fitness(_traffic(modeled_time_us=1.0, modeled_speedup=9.0)) == (1.0, 9.0)


def test_a_faster_tile_time_ranks_first_even_when_the_roofline_says_otherwise():
    # Two configs the roofline cannot tell apart (same bytes): the tile model can.
    small = _traffic(tile_time_us=900.0, modeled_time_us=100.0)
    large = _traffic(tile_time_us=300.0, modeled_time_us=100.0)
    cands = []
    for cid, t in (("small", small), ("large", large)):
        c = EvolveCandidate(candidate_id=cid, island=0, round=0, coder="builtin",
                            code_hash=cid, passed=True)
        c.modeled_time_us, c.modeled_speedup = modeled_fitness(t)
        cands.append(c)
    best = max(cands, key=lambda c: fitness_key(c, "modeled_time"))
    assert best.candidate_id == "large"


def test_at_equal_modeled_times_fewer_bytes_moved_rank_first():
    cands = [EvolveCandidate(candidate_id=cid, island=0, round=0, coder="builtin",
                             code_hash=cid, passed=True, modeled_time_us=3.0,
                             traffic_ratio=ratio)
             for cid, ratio in (("two-pass", 2.0), ("one-pass", 1.0), ("unknown", None))]
    ranked = sorted(cands, key=lambda c: fitness_key(c, "modeled_time"), reverse=True)
    assert [c.candidate_id for c in ranked] == ["one-pass", "two-pass", "unknown"]
