"""The verdict waiter gets every verdict, also when its consumer is lost.

Real nats-server; the waiter connects with the generator's credentials. A lost
consumer is made the way a server failover loses it: the server-side consumer is
deleted under the subscription, so nothing is delivered to it any more.
"""

from __future__ import annotations

import asyncio

import pytest

from schemas import VerifyResult, encode, subjects
from services.common.bus import Bus, connect_bus
from services.common.settings import Settings
from services.common.verdicts import VERDICTS_RECOVERED, VerdictWaiter
from tests.conftest import as_role


def verdict(job_id: str, request_id: str, passed: bool = True) -> VerifyResult:
    return VerifyResult(request_id=request_id, job_id=job_id, candidate_id=f"{request_id}-c",
                        worker_id="w", device="0", passed=passed, stage=None if passed else "mismatch")


async def publish(bus: Bus, result: VerifyResult) -> None:
    await bus.js.publish(subjects.results(result.job_id), encode(result))


@pytest.fixture
async def generator_bus(settings: Settings):
    b = await connect_bus(as_role(settings, "generator"), "test-generator", role="generator")
    try:
        yield b
    finally:
        await b.close()


async def test_verdicts_before_and_after_subscribing_reach_their_waiters(
        bus: Bus, generator_bus: Bus) -> None:
    await publish(bus, verdict("job-v1", "early"))
    await publish(bus, verdict("job-other", "not-mine"))
    async with VerdictWaiter(generator_bus.js, "job-v1") as waiter:
        assert (await waiter.wait("early", 5)).request_id == "early"
        late = waiter.expect("late")
        await publish(bus, verdict("job-v1", "late", passed=False))
        await publish(bus, verdict("job-v1", "late"))  # a second copy: the first counts
        result = await asyncio.wait_for(late, 5)
        assert (result.request_id, result.passed) == ("late", False)
        assert "not-mine" not in waiter.results
        with pytest.raises(TimeoutError):
            await waiter.wait("never", 0.3)


async def test_a_verdict_the_lost_consumer_never_delivers_is_caught_up(
        bus: Bus, generator_bus: Bus) -> None:
    before = VERDICTS_RECOVERED._value.get()
    async with VerdictWaiter(generator_bus.js, "job-v2", catch_up_s=0.2) as waiter:
        await publish(bus, verdict("job-v2", "first"))
        assert (await waiter.wait("first", 5)).passed
        consumers = await bus.js.consumers_info(subjects.STREAM_RESULTS)
        assert len(consumers) == 1, "the waiter's ordered consumer"
        await bus.js.delete_consumer(subjects.STREAM_RESULTS, consumers[0].name)

        await publish(bus, verdict("job-v2", "second", passed=False))
        # Well inside the two missed heartbeats (10 s) after which nats-py would try
        # to recreate the consumer: the catch-up read found it.
        result = await waiter.wait("second", 3)
        assert (result.request_id, result.passed) == ("second", False)
    assert VERDICTS_RECOVERED._value.get() == before + 1


async def test_malformed_verdicts_are_skipped(bus: Bus, generator_bus: Bus) -> None:
    await bus.js.publish(subjects.results("job-v3"), b"{not json")
    await bus.js.publish(subjects.results("job-v3"), b'{"request_id": 3}')
    await publish(bus, verdict("job-v3", "good"))
    waiter = VerdictWaiter(generator_bus.js, "job-v3", catch_up_s=0.1)
    await waiter.start()
    try:
        assert (await waiter.wait("good", 5)).passed
        assert await waiter.catch_up() == 0, "the catch-up resumes after the last sequence seen"
    finally:
        await waiter.stop()
