"""The SDK's one wait for a job (services/sdk/job_wait.py): its policy on a clock the
test moves, and the blocking and asyncio clients against a gateway that is not there."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.sdk.client import AIKGClient, AsyncAIKGClient
from services.sdk.errors import AIKGConnectionError
from services.sdk.job_wait import JobWait


class Clock:
    """Seconds that pass only when the test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_policy_ends_on_a_terminal_status_and_gives_up_at_the_deadline() -> None:
    clock, seen = Clock(), []
    wait = JobWait("job-1", timeout=5.0, poll_interval=2.0, unreachable_grace_s=0.0,
                   watchers=[seen.append, None], clock=clock)
    assert not wait.ended({"status": "running"})
    assert wait.pause() == 2.0
    clock.now += 4.0
    assert wait.pause() == pytest.approx(1.0)  # never sleeps past the deadline
    assert wait.ended({"status": "cancelled"})
    assert [s["status"] for s in seen] == ["running", "cancelled"]
    clock.now += 1.0
    with pytest.raises(TimeoutError, match=r"job-1 did not finish within 5 s \(status "
                                           r"cancelled\); it goes on"):
        wait.pause()


def test_policy_tolerates_an_unreachable_gateway_for_the_grace_only() -> None:
    clock = Clock()
    gone = AIKGConnectionError("cannot reach", "http://gw:8000", "Connection refused")
    strict = JobWait("job-1", 60.0, 1.0, 0.0, [], clock)
    with pytest.raises(AIKGConnectionError) as raised:
        strict.lost(gone)
    assert raised.value is gone
    patient = JobWait("job-1", 60.0, 1.0, 30.0, [], clock)
    clock.now += 29.0
    patient.lost(gone)  # within the grace: the wait goes on
    patient.ended({"status": "running"})  # an answer restarts the grace
    clock.now += 29.0
    patient.lost(gone)
    clock.now += 2.0
    with pytest.raises(AIKGConnectionError, match="lost the gateway at http://gw:8000 for "
                                                  "30 s") as raised:
        patient.lost(gone)
    assert raised.value.reason == "Connection refused, for 30 s"


def test_clients_wait_out_the_grace_then_raise(free_port) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with AIKGClient(url, token="") as client:
        with pytest.raises(AIKGConnectionError, match="cannot reach the AIKG gateway"):
            client.wait_for_completion("job-x", timeout=5, progress=False)
        started = time.monotonic()
        with pytest.raises(AIKGConnectionError, match="lost the gateway") as raised:
            client.wait_for_completion("job-x", timeout=5, poll_interval=0.05, progress=False,
                                       unreachable_grace_s=0.3)
        assert 0.3 <= time.monotonic() - started < 4
        assert raised.value.url == url

    async def wait_async() -> None:
        async with AsyncAIKGClient(url, token="") as client:
            await client.wait_for_completion("job-x", timeout=5, poll_interval=0.05,
                                             progress=False, unreachable_grace_s=0.2)

    with pytest.raises(AIKGConnectionError, match="lost the gateway"):
        asyncio.run(wait_async())


def _phase_gateway(job_id: str, running_polls: int):
    """A gateway that answers ``running`` ``running_polls`` times, then ``completed``,
    and streams the job's events: three phases of its verification, its verdict, its end."""
    import json

    import httpx

    polls = []
    events = [{"job_id": job_id, "event": "verify_started", "candidate_id": "c1"},
              *({"job_id": job_id, "event": "verify_phase", "candidate_id": "c1",
                 "message": text, "phase": {"name": name, "label": text}}
                for name, text in (("reference_start", "reference"),
                                   ("trials", "trial 1 of 3"), ("checks", "compile check"))),
              {"job_id": job_id, "event": "verify_result", "candidate_id": "c1"},
              {"job_id": job_id, "event": "completed", "status": "completed"}]
    body = "".join(f"id: {i}\nevent: {e['event']}\ndata: {json.dumps(e)}\n\n"
                   for i, e in enumerate(events, 1))

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/events"):
            return httpx.Response(200, text=body,
                                  headers={"content-type": "text/event-stream"})
        polls.append(1)
        status = "running" if len(polls) <= running_polls else "completed"
        return httpx.Response(200, json={"job_id": job_id, "status": status})

    return httpx.MockTransport(answer)


def test_blocking_wait_yields_the_job_events_with_its_phases_in_order() -> None:
    import httpx

    client = AIKGClient("http://gw")
    client._http = httpx.Client(base_url="http://gw", transport=_phase_gateway("j1", 5))
    seen: list[dict] = []
    with client:
        final = client.wait_for_completion("j1", timeout=10, poll_interval=0.2,
                                           progress=False, on_event=seen.append)
    assert final["status"] == "completed"
    assert [e["event"] for e in seen] == ["verify_started", "verify_phase", "verify_phase",
                                          "verify_phase", "verify_result", "completed"]
    assert [e["message"] for e in seen if e["event"] == "verify_phase"] == [
        "reference", "trial 1 of 3", "compile check"]
    assert [e["seq"] for e in seen] == [1, 2, 3, 4, 5, 6]


async def test_async_wait_yields_the_job_events_with_its_phases_in_order() -> None:
    import httpx

    client = AsyncAIKGClient("http://gw")
    client._http = httpx.AsyncClient(base_url="http://gw",
                                     transport=_phase_gateway("j1", 5))
    seen: list[dict] = []
    async with client:
        final = await client.wait_for_completion("j1", timeout=10, poll_interval=0.2,
                                                 progress=False, on_event=seen.append)
    assert final["status"] == "completed"
    assert [e["message"] for e in seen if e["event"] == "verify_phase"] == [
        "reference", "trial 1 of 3", "compile check"]


def test_a_wait_without_an_event_stream_still_ends_on_its_status() -> None:
    import httpx

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/events"):
            return httpx.Response(404, json={"detail": "no such route"})
        return httpx.Response(200, json={"job_id": "j1", "status": "completed"})

    client = AIKGClient("http://gw")
    client._http = httpx.Client(base_url="http://gw", transport=httpx.MockTransport(answer))
    seen: list[dict] = []
    with client:
        assert client.wait_for_completion("j1", timeout=5, poll_interval=0.1, progress=False,
                                          on_event=seen.append)["status"] == "completed"
    assert seen == []
