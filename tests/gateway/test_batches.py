"""Batch verification routes (services/gateway/batches.py) without a real worker: bad
input, tenant limits counted in candidates, tenant isolation, deduplication and
cancellation before any request was delivered.

A fake heartbeat stands in for the worker, so every verify request stays in VERIFY
(nothing takes it) and what the gateway published can be read back from the stream.
The verdicts of a real worker: tests/e2e/test_batch.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import msgspec
import nats.js.errors
import pytest
from httpx_sse import aconnect_sse

from schemas import VerifyRequest, decode, subjects
from services.common.bus import Bus
from services.common.settings import Settings
from services.gateway.batch_store import plan_candidates
from tests.gateway.test_tenants import auth, gateway, tenants_file
from tests.helpers import RELU_KERNEL, RELU_TASK, WRONG_RELU_KERNEL, scaled


async def queued_requests(bus: Bus, subject: str) -> list[VerifyRequest]:
    """The verify requests on ``subject`` still in VERIFY (a work-queue stream takes no
    ordered consumer: read message by message)."""
    out, seq = [], 0
    while True:
        try:
            raw = await bus.js.get_msg(subjects.STREAM_VERIFY, seq=seq + 1, subject=subject,
                                       next=True)
        except nats.js.errors.NotFoundError:
            return out
        seq = raw.seq
        out.append(decode(raw.data, VerifyRequest))


def batch(candidates: list, **fields) -> dict:
    return {"op_name": "relu", "task_desc": RELU_TASK, "candidates": candidates,
            "backend": "cpu", "trials": 1, **fields}


def test_identical_candidates_share_one_request() -> None:
    reformatted = RELU_KERNEL.replace("    m = offs < n\n", "    m = offs < n  # mask\n\n")
    planned = plan_candidates("b1", [RELU_KERNEL, WRONG_RELU_KERNEL, reformatted, "x = ("])
    assert [c.request_id for c in planned] == ["b1-r0", "b1-r1", "b1-r0", "b1-r3"]
    assert [c.duplicate_of for c in planned] == [None, None, 0, None]
    assert [c.candidate_id for c in planned] == ["b1-c0", "b1-c1", "b1-c2", "b1-c3"]
    assert planned[0].code_hash == planned[2].code_hash != planned[1].code_hash


async def test_bad_batches_are_refused_with_the_field_named(
        settings: Settings, bus: Bus, fake_worker_heartbeat, start_gateway) -> None:
    await fake_worker_heartbeat(bus)
    settings = msgspec.structs.replace(settings, batch_max_candidates=3)
    url = await start_gateway(settings)
    async with httpx.AsyncClient(base_url=url, timeout=scaled(15)) as client:
        cases = {
            "empty": (batch([]), 400, "candidates"),
            "missing": ({"op_name": "relu", "task_desc": RELU_TASK}, 400, "candidates"),
            "not a string": (batch([RELU_KERNEL, 7]), 400, "$.candidates[1]"),
            "too many": (batch([RELU_KERNEL] * 4), 400, "AIKG_BATCH_MAX_CANDIDATES"),
            "long id": (batch([RELU_KERNEL], batch_id="b" * 57), 400, "batch_id"),
            "bad task": (batch([RELU_KERNEL], task_desc="x = 1\n"), 400, "Model"),
            "unknown field": (batch([RELU_KERNEL], max_rounds=2), 400, "max_rounds"),
            "no worker": (batch([RELU_KERNEL], backend="cuda"), 409, "no live worker"),
        }
        for name, (body, status, says) in cases.items():
            r = await client.post("/api/v1/verify/batch", json=body)
            assert r.status_code == status, (name, r.text)
            assert says in r.json()["detail"], (name, r.json())
        r = await client.get("/api/v1/verify/batch/nobody")
        assert r.status_code == 404 and "unknown batch" in r.json()["detail"]
        r = await client.post("/api/v1/verify/batch/no.such/cancel")
        assert r.status_code == 404
    # Nothing of the refused batches reached the bus.
    assert await queued_requests(bus, f"{subjects.VERIFY_PREFIX}.>") == []
    with pytest.raises(nats.js.errors.NoKeysError):
        await bus.batches.keys()


async def test_duplicates_are_sent_once_and_cancel_takes_back_what_did_not_start(
        settings: Settings, bus: Bus, fake_worker_heartbeat, start_gateway) -> None:
    await fake_worker_heartbeat(bus)
    url = await start_gateway(settings)
    codes = [RELU_KERNEL, WRONG_RELU_KERNEL, RELU_KERNEL + "\n# the same kernel\n",
             RELU_KERNEL.replace("1024", "512")]
    async with httpx.AsyncClient(base_url=url, timeout=scaled(15)) as client:
        r = await client.post("/api/v1/verify/batch", json=batch(codes, batch_id="b-dup"))
        assert r.status_code == 200, r.text
        answer = r.json()
        assert (answer["batch_id"], answer["candidates"], answer["unique"]) == ("b-dup", 4, 3)
        # The same batch again is idempotent; other candidates under its id are a 409.
        again = await client.post("/api/v1/verify/batch", json=batch(codes, batch_id="b-dup"))
        assert again.status_code == 200 and again.json()["message"] == "batch already submitted"
        other = await client.post("/api/v1/verify/batch",
                                  json=batch(codes[:2], batch_id="b-dup"))
        assert other.status_code == 409 and "taken" in other.json()["detail"]

        sent = await queued_requests(bus, subjects.verify("cpu", "x86_64"))
        assert [(q.request_id, q.job_id, q.candidate_id) for q in sent] == [
            ("b-dup-r0", "b-dup", "b-dup-c0"), ("b-dup-r1", "b-dup", "b-dup-c1"),
            ("b-dup-r3", "b-dup", "b-dup-c3")]
        assert {q.trials for q in sent} == {1} and sent[1].code == WRONG_RELU_KERNEL

        record = (await client.get("/api/v1/verify/batch/b-dup")).json()
        assert record["status"] == "running" and record["verdicts"] == []
        assert [c["duplicate_of"] for c in record["candidates"]] == [None, None, 0, None]
        assert all(c["verify_seq"] > 0 for c in record["candidates"] if c["duplicate_of"] is None)

        # No worker took any request: cancelling takes every one back.
        cancelled = (await client.post("/api/v1/verify/batch/b-dup/cancel")).json()
        assert cancelled["status"] == "cancelled"
        assert all(c["cancelled"] for c in cancelled["candidates"]), cancelled["candidates"]
        assert await queued_requests(bus, subjects.verify("cpu", "x86_64")) == []
        # The event stream says so and ends.
        async with aconnect_sse(client, "GET", "/api/v1/verify/batch/b-dup/events") as source:
            events = [(sse.event, json.loads(sse.data)) async for sse in source.aiter_sse()
                      if sse.data]
        assert events == [("end", {"batch_id": "b-dup", "status": "cancelled",
                                   "candidates": 4, "verdicts": 0, "cancelled": 4})]
        # A resume id that is not a verdict id is refused.
        for bad, said in (("x", "must be a verdict id"), ("-1", "must not be negative")):
            r = await client.get("/api/v1/verify/batch/b-dup/events",
                                 headers={"Last-Event-ID": bad})
            assert r.status_code == 400 and said in r.json()["detail"], r.text
        # Cancelling again changes nothing.
        assert (await client.post("/api/v1/verify/batch/b-dup/cancel")).json()["status"] \
            == "cancelled"


async def test_batch_candidates_count_against_tenant_limits_and_stay_private(
        tmp_path: Path, settings: Settings, bus: Bus, fake_worker_heartbeat,
        start_gateway) -> None:
    await fake_worker_heartbeat(bus)
    settings = msgspec.structs.replace(settings, tenants_file=tenants_file(
        tmp_path, team_b={"max_jobs_per_hour": 10}))
    codes = [RELU_KERNEL.replace("1024", str(2 ** k)) for k in range(5, 12)]  # 7 distinct
    async with gateway(start_gateway, settings) as client:
        # team_a: 30 in flight. 20 candidates (7 requests) are 20 of them.
        r = await client.post("/api/v1/verify/batch", headers=auth("team_a"),
                              json=batch((codes * 3)[:20], batch_id="a-20"))
        assert r.status_code == 200 and r.json()["unique"] == 7, r.text
        r = await client.post("/api/v1/verify/batch", headers=auth("team_a"),
                              json=batch((codes * 2)[:11], batch_id="a-11"))
        assert r.status_code == 429 and r.json()["limit"] == "max_in_flight", r.text
        assert "this batch asks for 11" in r.json()["detail"]
        # A job is one more: 21 of 30.
        r = await client.post("/api/v1/jobs/submit", headers=auth("team_a"), json={
            "op_name": "relu", "task_desc": RELU_TASK, "init_code": RELU_KERNEL})
        assert r.status_code == 200, r.text
        r = await client.post("/api/v1/verify/batch", headers=auth("team_a"),
                              json=batch(codes + codes[:3], batch_id="a-9"))
        assert r.status_code == 429, r.text
        # Cancelling the batch frees its 20.
        assert (await client.post("/api/v1/verify/batch/a-20/cancel",
                                  headers=auth("team_a"))).json()["status"] == "cancelled"
        r = await client.post("/api/v1/verify/batch", headers=auth("team_a"),
                              json=batch(codes + codes[:2], batch_id="a-9"))
        assert r.status_code == 200, r.text

        # team_b: 10 per hour, counted in candidates.
        r = await client.post("/api/v1/verify/batch", headers=auth("team_b"),
                              json=batch(codes[:6], batch_id="b-6"))
        assert r.status_code == 200, r.text
        r = await client.post("/api/v1/verify/batch", headers=auth("team_b"),
                              json=batch(codes[:5], batch_id="b-5"))
        assert r.status_code == 429 and r.json()["limit"] == "max_jobs_per_hour", r.text

        # Another tenant's batch is answered as one that does not exist.
        for method, path in (("GET", "/api/v1/verify/batch/a-9"),
                             ("GET", "/api/v1/verify/batch/a-9/events"),
                             ("POST", "/api/v1/verify/batch/a-9/cancel")):
            r = await client.request(method, path, headers=auth("team_b"))
            assert r.status_code == 404, (method, path, r.text)
        r = await client.post("/api/v1/verify/batch", headers=auth("team_b"),
                              json=batch(codes[:1], batch_id="a-9"))
        assert r.status_code == 409 and "a-9" in r.json()["detail"], r.text
        assert (await client.get("/api/v1/verify/batch/a-9", headers=auth("team_a"))
                ).json()["status"] == "running"
        # Batch requests go on the tenant's VERIFY lane.
        lane = subjects.verify_lane("cpu", "x86_64", "team_a", "normal")
        assert {q.job_id for q in await queued_requests(bus, lane)} == {"a-9"}
