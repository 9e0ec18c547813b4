"""Which verdicts count: only the worker that holds a request decides it.

Real nats-server with the project's users: the waiter reads with the generator's
credentials, the workers publish with their own (``worker-test-worker`` and
``worker-test-worker-2``), so every refusal here is the server's or the reader's, as
in a deployed fleet.
"""

from __future__ import annotations

import asyncio

import nats
import pytest

from schemas import VerifyClaim, VerifyResult, encode, subjects
from services.common.bus import Bus, connect_bus
from services.common.settings import Settings
from services.common.verdicts import (
    VERDICTS_RECOVERED,
    VERDICTS_REJECTED,
    VerdictWaiter,
    claim_nonce,
    proof,
    random_key,
)
from tests.conftest import TEST_WORKER_IDS, as_role
from tests.helpers import poll_until

W1, W2 = TEST_WORKER_IDS


def rejected(reason: str) -> float:
    return VERDICTS_REJECTED.labels(reason=reason)._value.get()


async def until_rejected(counts: dict[str, float]) -> None:
    """Until each reason's rejections reach their count: the waiter has read (and
    dropped) those messages, so whatever they could have ended has had its chance."""
    async def reached() -> bool:
        return all(rejected(reason) >= n for reason, n in counts.items())

    await poll_until(reached, 10, f"verdict rejections {counts}", every_s=0.02)


class Worker:
    """A NATS client with one worker's credentials that claims and answers requests by
    hand (what a real worker or a compromised one can publish)."""

    def __init__(self, nc, worker_id: str) -> None:
        self.nc, self.js, self.worker_id = nc, nc.jetstream(), worker_id

    async def claim(self, job_id: str, request_id: str, nonce: str | None) -> None:
        good = proof(nonce, "claim", self.worker_id, request_id) if nonce else "forged"
        await self.js.publish(subjects.claims(job_id, self.worker_id), encode(VerifyClaim(
            request_id=request_id, job_id=job_id, worker_id=self.worker_id, proof=good)))

    def result(self, job_id: str, request_id: str, nonce: str | None, *, passed: bool,
               speedup: float | None = None) -> VerifyResult:
        good = proof(nonce, "result", self.worker_id, request_id) if nonce else "forged"
        return VerifyResult(request_id=request_id, job_id=job_id, candidate_id="c",
                            worker_id=self.worker_id, device="0", passed=passed,
                            stage=None if passed else "mismatch", speedup=speedup, proof=good)

    async def answer(self, job_id: str, request_id: str, nonce: str | None, *,
                     passed: bool, speedup: float | None = None) -> None:
        await self.js.publish(subjects.results(job_id, self.worker_id), encode(
            self.result(job_id, request_id, nonce, passed=passed, speedup=speedup)))


@pytest.fixture
async def generator_bus(settings: Settings):
    b = await connect_bus(as_role(settings, "generator"), "test-generator", role="generator")
    try:
        yield b
    finally:
        await b.close()


@pytest.fixture
async def workers(settings: Settings, bus_credentials):
    out = []
    for worker_id in (W1, W2):
        own = bus_credentials.worker_settings(worker_id)
        nc = await nats.connect(settings.nats_url, user=own["nats_worker_user"],
                                password=own["nats_worker_password"],
                                inbox_prefix=f"_INBOX_{own['nats_worker_user']}")
        out.append(Worker(nc, worker_id))
    try:
        yield out
    finally:
        for w in out:
            await w.nc.close()


async def test_the_holders_verdicts_reach_their_waiters_before_and_after_subscribing(
        generator_bus: Bus, workers: list[Worker]) -> None:
    w1, _ = workers
    key = random_key()
    nonce = claim_nonce(key, "early")
    await w1.claim("job-v1", "early", nonce)
    await w1.answer("job-v1", "early", nonce, passed=True)
    async with VerdictWaiter(generator_bus.js, "job-v1", key) as waiter:
        assert (await waiter.wait("early", 5)).request_id == "early"
        late = waiter.expect("late")
        nonce = claim_nonce(key, "late")
        await w1.claim("job-v1", "late", nonce)
        await w1.answer("job-v1", "late", nonce, passed=False)
        await w1.answer("job-v1", "late", nonce, passed=True)  # a second copy: the first counts
        result = await asyncio.wait_for(late, 5)
        assert (result.request_id, result.passed, result.worker_id) == ("late", False, W1)
        with pytest.raises(TimeoutError):
            await waiter.wait("never", 0.3)


async def test_a_second_workers_forged_passing_verdict_is_ignored(
        settings: Settings, generator_bus: Bus, workers: list[Worker]) -> None:
    """w1 holds the request; w2 knows the job and request ids (they are no secret) but
    was never delivered the request, so it lacks the nonce: its claim and its passing
    verdict with speedup 999 do not count, on its own subject or on w1's."""
    w1, w2 = workers
    key = random_key()
    nonce = claim_nonce(key, "r1")
    before = {r: rejected(r) for r in ("bad_proof", "unclaimed", "not_holder")}
    async with VerdictWaiter(generator_bus.js, "job-forged", key) as waiter:
        pending = waiter.expect("r1")
        await w1.claim("job-forged", "r1", nonce)
        await w2.claim("job-forged", "r1", None)           # no nonce: a bad proof
        await w2.answer("job-forged", "r1", None, passed=True, speedup=999.0)
        # On w1's subject the server refuses it (a worker publishes under its own id).
        with pytest.raises(nats.errors.Error):
            await w2.js.publish(subjects.results("job-forged", W1), encode(
                w2.result("job-forged", "r1", None, passed=True, speedup=999.0)))
        await until_rejected({"bad_proof": before["bad_proof"] + 2})  # claim and verdict
        assert not pending.done(), "the forged verdict ended the wait"
        await w1.answer("job-forged", "r1", nonce, passed=False)
        result = await asyncio.wait_for(pending, 5)
    assert (result.worker_id, result.passed, result.speedup) == (W1, False, None)
    assert rejected("bad_proof") >= before["bad_proof"] + 2  # the claim and the verdict


async def test_a_workers_proof_for_another_worker_does_not_transfer(
        generator_bus: Bus, workers: list[Worker]) -> None:
    """Even a worker that learnt the nonce (it was delivered the request earlier and gave
    it back) decides nothing once another worker holds the request: the latest claim
    names the holder, and a verdict from anyone else is dropped (not_holder)."""
    w1, w2 = workers
    key = random_key()
    nonce = claim_nonce(key, "r2")
    before = rejected("not_holder")
    async with VerdictWaiter(generator_bus.js, "job-redelivered", key) as waiter:
        pending = waiter.expect("r2")
        await w2.claim("job-redelivered", "r2", nonce)     # delivered first, gave it back
        await w1.claim("job-redelivered", "r2", nonce)     # JetStream gave it to w1
        await w2.answer("job-redelivered", "r2", nonce, passed=True, speedup=999.0)
        await until_rejected({"not_holder": before + 1})
        assert not pending.done()
        await w1.answer("job-redelivered", "r2", nonce, passed=True, speedup=1.5)
        result = await asyncio.wait_for(pending, 5)
    assert (result.worker_id, result.speedup) == (W1, 1.5)
    assert rejected("not_holder") == before + 1


async def test_relayed_unclaimed_and_malformed_messages_are_skipped(
        bus: Bus, generator_bus: Bus, workers: list[Worker]) -> None:
    w1, _ = workers
    key = random_key()
    nonce = claim_nonce(key, "r3")
    before = {r: rejected(r) for r in ("relayed", "unclaimed", "malformed", "wrong_subject")}
    good = w1.result("job-v3", "r3", nonce, passed=True)
    # A copy the server relayed (a JetStream direct get's reply sent onto a results
    # subject carries these headers); planted here by the admin.
    await bus.js.publish(subjects.results("job-v3", W1), encode(good),
                         headers={"Nats-Stream": "KV_workers", "Nats-Subject": "$KV.workers.x"})
    await w1.answer("job-v3", "r3", nonce, passed=True)    # before any claim
    await w1.js.publish(subjects.results("job-v3", W1), b"{not json")
    await bus.js.publish(subjects.results("job-v3", W2), encode(good))  # body names w1
    async with VerdictWaiter(generator_bus.js, "job-v3", key, catch_up_s=0.1) as waiter:
        pending = waiter.expect("r3")
        await until_rejected({reason: n + 1 for reason, n in before.items()})
        assert not pending.done()
        await w1.claim("job-v3", "r3", nonce)
        await w1.answer("job-v3", "r3", nonce, passed=True)
        assert (await asyncio.wait_for(pending, 5)).passed
        assert await waiter.catch_up() == 0, "a read resumes after the last sequence seen"
    for reason in before:
        assert rejected(reason) == before[reason] + 1, reason


async def test_a_verdict_no_wake_up_announced_is_read_all_the_same(
        generator_bus: Bus, workers: list[Worker]) -> None:
    w1, _ = workers
    key = random_key()
    before = VERDICTS_RECOVERED._value.get()
    async with VerdictWaiter(generator_bus.js, "job-v4", key, catch_up_s=0.3) as waiter:
        pending = waiter.expect("r4")
        await waiter._sub.unsubscribe()  # a wake-up lost (a reconnect, a slow consumer)
        await asyncio.sleep(0.5)  # the read expect() asked for is over
        nonce = claim_nonce(key, "r4")
        await w1.claim("job-v4", "r4", nonce)
        await w1.answer("job-v4", "r4", nonce, passed=True)
        assert (await asyncio.wait_for(pending, 5)).passed
    assert VERDICTS_RECOVERED._value.get() == before + 1


async def test_a_jobs_and_a_batchs_keys_are_kept_where_a_restart_finds_them(
        bus: Bus, generator_bus: Bus, settings: Settings) -> None:
    """A generator that resumes a job (after a crash, or with rotated bus credentials)
    reads the job's key again, so the verdicts of requests sent before still count; two
    jobs' keys differ; a batch's key is made once and read by every gateway."""
    from services.common.verdicts import batch_key, forget_job_key, job_key

    first = await job_key(generator_bus.js, "job-k1")
    assert len(first) == 32
    again = await connect_bus(as_role(settings, "generator"), "test-generator-2",
                              role="generator")
    try:
        assert await job_key(again.js, "job-k1") == first
    finally:
        await again.close()
    assert await job_key(generator_bus.js, "job-k2") != first
    await forget_job_key(generator_bus.js, "job-k1")
    assert await job_key(generator_bus.js, "job-k1") != first  # a new job's, after the end

    made = await batch_key(bus.batches, "batch-k1")
    assert await batch_key(bus.batches, "batch-k1") == made
    assert await batch_key(bus.batches, "batch-k2") != made
