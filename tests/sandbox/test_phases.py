"""Where the time goes: per-phase timings of verifications and jobs.

A real sandboxed Verifier checks the built-in coder's relu kernel (passing) and a
wrong one (mismatch); a full stack (gateway, generator, one cpu worker over a real
nats-server) runs one single job. The phases must name known phases, and the
consecutive ones must add up to the verification's (or the job's) wall time.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
from pathlib import Path

import httpx
import pytest
from prometheus_client import REGISTRY

from schemas import JOB_PHASES, VERIFY_PHASES, VERIFY_PHASES_BESIDE, VerifyRequest
from schemas.events import VerifyPhase, phase_label
from services.common.bus import Bus
from services.common.settings import Settings
from services.common.verify_client import build_request
from services.generator.lowering import lower_task
from services.worker.verifier import Verifier
from tests.conftest import RELU_TASK
from tests.helpers import WRONG_RELU_KERNEL, job_events, scaled, wait_terminal

SHAPES = {"batch_size": 16, "dim": 1024}
# The rule: phases add up to the wall time within 10%.
TOLERANCE = 0.10


@functools.cache
def relu_candidate() -> str:
    return lower_task(RELU_TASK, SHAPES)


@pytest.fixture(scope="module")
def verifier(shared_verifier: Verifier) -> Verifier:
    return shared_verifier


def request(code: str, n: int) -> VerifyRequest:
    return build_request(request_id=f"ph-{n}", job_id="phases", candidate_id=f"c{n}",
                         op_name="relu", task_desc=RELU_TASK, code=code, backend="cpu",
                         arch="test", shape_overrides=dict(SHAPES), trials=3, timeout_s=120.0)


def consecutive_sum(phases: dict[str, float]) -> float:
    return sum(v for k, v in phases.items() if k not in VERIFY_PHASES_BESIDE)


def assert_known(phases: dict[str, float]) -> None:
    unknown = {k for k in phases if phase_label(k) not in VERIFY_PHASES}
    assert not unknown, f"phases not in VERIFY_PHASES: {unknown}"
    assert all(v >= 0 for v in phases.values()), phases


def assert_in_order(seen: list[VerifyPhase]) -> None:
    """Phases as reported: in the order of VERIFY_PHASES, trials counted up, the
    verdict last."""
    order = list(VERIFY_PHASES)
    ranks = [order.index(p.name) for p in seen]
    assert ranks == sorted(ranks), [(p.name, p.state, p.label) for p in seen]
    trials = [p.trial for p in seen if p.trial is not None]
    assert trials == sorted(trials), trials
    assert (seen[-1].name, seen[-1].state) == ("verdict", "ended"), seen[-1]


async def test_passing_verification_phases_add_up_to_its_wall_time(verifier: Verifier) -> None:
    seen: list[VerifyPhase] = []
    first = await verifier.verify(request(relu_candidate(), 1), device="0",
                                  on_phase=seen.append)
    second = await verifier.verify(request(relu_candidate(), 2), device="0")
    # Told as they happen: each phase starting (a trial of three, the checks' steps)
    # and ending, with the seconds its span took.
    assert_in_order(seen)
    labels = [p.label for p in seen if p.state == "started"]
    for text in ("static checks", "reference", "trial 1 of 3", "trial 3 of 3",
                 "other sizes", "replays", "compile check", "verdict"):
        assert text in labels, (text, labels)
    ended = {p.name: p.seconds or 0.0 for p in seen if p.state == "ended"}
    spans = {k: v for k, v in first.phases.items() if k not in VERIFY_PHASES_BESIDE}
    assert ended.keys() == spans.keys(), (ended, spans)
    assert all(abs(ended[k] - spans[k]) < 0.002 for k in spans), (ended, spans)
    for result in (first, second):
        assert result.passed, (result.stage, result.error, result.log)
        assert_known(result.phases)
        total = consecutive_sum(result.phases)
        assert abs(total - result.duration_s) <= TOLERANCE * result.duration_s, (
            total, result.duration_s, result.phases)
        for name in ("static", "reference_start", "candidate_start", "trials", "checks",
                     "verdict", "reference", "candidate", "replay"):
            assert name in result.phases, (name, result.phases)


async def test_failed_verification_phases_add_up_to_its_wall_time(verifier: Verifier) -> None:
    code = WRONG_RELU_KERNEL
    result = await verifier.verify(request(code, 3), device="0")
    assert not result.passed and result.stage == "mismatch", (result.stage, result.error)
    assert_known(result.phases)
    assert "candidate_start" in result.phases and "verdict" in result.phases
    total = consecutive_sum(result.phases)
    assert abs(total - result.duration_s) <= TOLERANCE * result.duration_s, result.phases


def histogram_count(name: str, **labels: str) -> float:
    value = REGISTRY.get_sample_value(f"{name}_count", labels)
    return value or 0.0


async def test_job_and_its_verification_record_their_phases(
        shared_services, settings: Settings, bus: Bus, gateway: str) -> None:
    task = (Path(__file__).resolve().parents[2] / "tasks" / "relu.py").read_text()
    labels = {"backend": "cpu", "arch": settings.arch}
    trials_before = histogram_count("aikg_verify_phase_seconds", phase="trials", **labels)
    async with shared_services(settings, bus), httpx.AsyncClient(base_url=gateway,
                                                                  timeout=scaled(30)) as client:
        resp = await client.post("/api/v1/jobs/submit", json={
            "op_name": "relu", "task_desc": task, "backend": "cpu"})
        assert resp.status_code in (200, 201), resp.text
        record = await wait_terminal(client, resp.json()["job_id"])
    assert record["status"] == "completed", record.get("error")
    phases = record["phases"]
    assert set(phases) <= set(JOB_PHASES), phases
    for name in ("queue", "lowering", "verify_wait", "other"):
        assert name in phases, (name, phases)
    assert phases["lowering"] > 0 and phases["verify_wait"] > 0
    wall = (dt.datetime.fromisoformat(record["end_time"])
            - dt.datetime.fromisoformat(record["submit_time"])).total_seconds()
    assert abs(sum(phases.values()) - wall) <= TOLERANCE * wall, (phases, wall)

    verdict = record["result"]["verdict"]
    vphases = verdict["phases"]
    assert_known(vphases)
    for name in ("queue", "fetch_to_start", "lease", "trials", "replay"):
        assert name in vphases, (name, vphases)
    # The worker's phases went out as they happened: on the job's events subject,
    # in order, before its verdict's event.
    events = await job_events(bus, record["job_id"])
    kinds = [e.event for e in events]
    shown = [e for e in events if e.event == "verify_phase"]
    assert len(shown) >= 3, kinds
    assert max(i for i, k in enumerate(kinds) if k == "verify_phase") < \
        kinds.index("verify_result"), kinds
    assert {e.request_id for e in shown} == {verdict["request_id"]}
    assert all(e.phase is not None and e.message == e.phase.label for e in shown)
    assert_in_order([e.phase for e in shown if e.phase is not None])
    # The verdict's wait as the generator saw it holds the worker's own phases.
    assert vphases["trials"] < phases["verify_wait"]
    await asyncio.sleep(0)
    assert histogram_count("aikg_verify_phase_seconds", phase="trials",
                           **labels) > trials_before
    assert histogram_count("aikg_verify_phase_seconds", phase="publish", **labels) > 0
    assert histogram_count("aikg_job_phase_seconds", job_type="single",
                           phase="verify_wait") > 0


async def test_builtin_coder_reuses_a_lowering_of_the_same_task(lowering_sandbox) -> None:
    from schemas import JobSubmit
    from services.generator.coders.base import BuiltinCoder

    coder = BuiltinCoder(lowering_sandbox)
    submit = JobSubmit(op_name="relu", task_desc=RELU_TASK, shape_overrides=dict(SHAPES))
    first = await coder.generate(submit)
    again = await coder.generate(submit)
    assert again.code == first.code and coder.lowerings == 1
    # Other shapes, or another source, are another lowering.
    other = await coder.generate(JobSubmit(op_name="relu", task_desc=RELU_TASK,
                                           shape_overrides={"batch_size": 8, "dim": 512}))
    assert "float32[8, 512]" in other.code and coder.lowerings == 2
    await coder.generate(JobSubmit(op_name="relu", task_desc=RELU_TASK + "\n# changed\n",
                                   shape_overrides=dict(SHAPES)))
    assert coder.lowerings == 3


async def test_builtin_coder_evicts_the_least_recently_used_lowering(lowering_sandbox,
                                                                    monkeypatch) -> None:
    from schemas import JobSubmit
    from services.generator.coders import base

    monkeypatch.setattr(base, "LOWERED_CACHE_ENTRIES", 2)
    coder = base.BuiltinCoder(lowering_sandbox)

    def submit(batch: int) -> JobSubmit:
        return JobSubmit(op_name="relu", task_desc=RELU_TASK,
                         shape_overrides={"batch_size": batch, "dim": 256})

    await coder.generate(submit(1))
    await coder.generate(submit(2))
    await coder.generate(submit(1))  # a hit: batch 1 is now the most recently used
    assert coder.lowerings == 2
    await coder.generate(submit(3))  # past the bound: batch 2 goes
    assert coder.lowerings == 3
    await coder.generate(submit(1))
    assert coder.lowerings == 3, "the most recently used lowering was evicted"
    await coder.generate(submit(2))
    assert coder.lowerings == 4, "the least recently used lowering was kept"
