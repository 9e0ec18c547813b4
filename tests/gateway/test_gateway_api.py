"""The gateway routes beyond submit and status: list, cancel, kernel, events (SSE), workers.

Gateway served by uvicorn in the test's loop, against a real nats-server; the
generator's part is played by the test (records and events written directly), so
each test takes well under a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json

import httpx
import msgspec
import pytest

from schemas import JobEvent, JobResult, VerifyResult, encode, subjects
from services.common.bus import Bus, JobStore
from services.common.jobs import publish_event
from services.common.settings import Settings
from tests import support_gateway
from tests.helpers import scaled

# The gateway tests' fixtures, shared with the other gateway test module.
client, cpu_worker, job = support_gateway.client, support_gateway.cpu_worker, support_gateway.job


async def submit(client: httpx.AsyncClient, body: dict) -> str:
    r = await client.post("/api/v1/jobs", json=body)
    assert r.status_code == 200, r.text
    return r.json()["job_id"]


def _result(job_id: str, code: str, passed: bool = True) -> JobResult:
    return JobResult(passed=passed, code=code, candidate_id="cand-1", coder="builtin", attempts=1,
                     verdict=VerifyResult(request_id="req-1", job_id=job_id, candidate_id="cand-1",
                                          worker_id="w1", device="0", passed=passed,
                                          interpreted=True))


async def finish(bus: Bus, job_id: str, status: str = "completed", *, code: str | None = None,
                 event: bool = True) -> None:
    """Do what the generator does at the end of a job: record first, then the event."""

    def change(rec):
        rec.status = status
        rec.end_time = dt.datetime.now(dt.UTC)
        if code is not None:
            rec.result = _result(job_id, code, passed=status == "completed")
        return rec

    await JobStore(bus.jobs).update(job_id, change)
    if event:
        await publish_event(bus, JobEvent(job_id=job_id, event=status, status=status))


async def read_sse(response: httpx.Response, *, until: str | None = None,
                   queued: bool = False) -> list[dict]:
    """Parse an event stream into ``{"id", "event", "data", "comment"}`` dicts until it
    ends (or after an event of kind ``until``); ``queued`` events (a waiting job's
    position, tests/gateway/test_tenants.py) only when ``queued``."""
    out: list[dict] = []
    block: dict = {}
    async for line in response.aiter_lines():
        if line == "":
            if block.get("event") == "queued" and not queued:
                block = {}
            if block:
                out.append(block)
                if until and block.get("event") == until:
                    return out
            block = {}
        elif line.startswith(":"):
            block["comment"] = line[1:].strip()
        else:
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            block[field] = value if field != "data" else block.get("data", "") + value
    if block:
        out.append(block)
    return out


# --- list ----------------------------------------------------------------------------


async def test_list_filters_pages_newest_first(client: httpx.AsyncClient, bus: Bus,
                                               cpu_worker: None, job) -> None:
    ids = [await submit(client, job(op_name=name, job_id=f"list-{i}"))
           for i, name in enumerate(["relu", "gelu", "relu", "tanh"])]
    await finish(bus, ids[1], "failed")

    page = (await client.get("/api/v1/jobs")).json()
    assert page["total"] == 4 and (page["limit"], page["offset"]) == (50, 0)
    assert [j["job_id"] for j in page["jobs"]] == ids[::-1]
    row = page["jobs"][0]
    assert {"job_id", "status", "op_name", "backend", "arch", "submit_time", "phase",
            "passed"} <= set(row)
    assert "request" not in row and "task_desc" not in json.dumps(row)

    relu = (await client.get("/api/v1/jobs", params={"op_name": "relu"})).json()
    assert [j["job_id"] for j in relu["jobs"]] == [ids[2], ids[0]] and relu["total"] == 2
    failed = (await client.get("/api/v1/jobs", params={"status": "failed"})).json()
    assert [j["job_id"] for j in failed["jobs"]] == [ids[1]]
    second = (await client.get("/api/v1/jobs", params={"limit": 2, "offset": 2})).json()
    assert [j["job_id"] for j in second["jobs"]] == [ids[1], ids[0]] and second["total"] == 4
    none = (await client.get("/api/v1/jobs", params={"status": "running"})).json()
    assert none == {"jobs": [], "total": 0, "limit": 50, "offset": 0}


async def test_list_empty_and_bad_query_is_400(client: httpx.AsyncClient) -> None:
    assert (await client.get("/api/v1/jobs")).json()["total"] == 0
    for params, word in (({"status": "done"}, "status"), ({"limit": 0}, "limit"),
                         ({"limit": 10_000}, "limit"), ({"offset": -1}, "offset")):
        r = await client.get("/api/v1/jobs", params=params)
        assert r.status_code == 400, (params, r.text)
        assert word in r.text


# --- corrupt records ----------------------------------------------------------------

GARBAGE = b"\x00\xff not a job record {"


async def test_corrupt_record_is_a_clear_error_on_every_route_and_listed_as_corrupt(
    client: httpx.AsyncClient, bus: Bus, cpu_worker: None, job
) -> None:
    good = await submit(client, job(job_id="good-1"))
    bad = await submit(client, job(job_id="bad-1"))
    await bus.jobs.put(bad, GARBAGE)
    # Well-formed JSON that breaks the schema is corrupt too, with the field named.
    await bus.jobs.put("bad-2", json.dumps({"job_id": "bad-2", "status": 7}).encode())

    for job_id, fault in ((bad, "JSON is malformed"), ("bad-2", "$.status")):
        for method, suffix in (("GET", ""), ("GET", "/status"), ("POST", "/cancel"),
                               ("GET", "/kernel"), ("GET", "/events")):
            r = await client.request(method, f"/api/v1/jobs/{job_id}{suffix}")
            assert r.status_code == 500, (method, suffix, r.text)
            body = r.json()
            assert body["detail"].startswith(f"job record {job_id} is corrupt: ")
            assert fault in body["detail"] and fault in body["fault"]
            assert f"nats kv del jobs {job_id}" in body["detail"]
            assert body["job_id"] == job_id
    # The cancel wrote nothing over the bad bytes.
    assert (await bus.jobs.get(bad)).value == GARBAGE
    # Resubmitting under a corrupt id says so too, instead of a bare 500.
    r = await client.post("/api/v1/jobs", json=job(job_id=bad))
    assert r.status_code == 500 and f"job record {bad} is corrupt" in r.json()["detail"]

    page = (await client.get("/api/v1/jobs")).json()
    rows = {row["job_id"]: row for row in page["jobs"]}
    assert page["total"] == 3 and set(rows) == {good, bad, "bad-2"}
    assert rows[good]["status"] == "pending"
    for job_id in (bad, "bad-2"):
        assert rows[job_id]["status"] == "corrupt"
        assert rows[job_id]["error"].startswith(f"job record {job_id} is corrupt")
        assert rows[job_id]["submit_time"]
    only = (await client.get("/api/v1/jobs", params={"status": "corrupt"})).json()
    assert sorted(j["job_id"] for j in only["jobs"]) == ["bad-1", "bad-2"]
    pending = (await client.get("/api/v1/jobs", params={"status": "pending"})).json()
    assert [j["job_id"] for j in pending["jobs"]] == [good]
    by_op = (await client.get("/api/v1/jobs", params={"op_name": "relu"})).json()
    assert [j["job_id"] for j in by_op["jobs"]] == [good]


async def test_event_stream_says_once_when_the_record_turns_corrupt(
    client: httpx.AsyncClient, bus: Bus, cpu_worker: None, job, monkeypatch
) -> None:
    from services.gateway import events

    checks: list[str] = []  # record checks of the event stream, and what they found

    class CountedStore(events.CheckedJobStore):
        async def get(self, job_id: str):
            try:
                found = await super().get(job_id)
            except Exception as exc:
                checks.append(type(exc).__name__)
                raise
            checks.append("record")
            return found

    monkeypatch.setattr(events, "RECORD_CHECK_S", 0.1)
    monkeypatch.setattr(events, "CheckedJobStore", CountedStore)
    job_id = await submit(client, job())
    got: list[dict] = []
    follower = asyncio.create_task(follow_events(client, job_id, got))
    await _until(lambda: len(got) == 1)
    await bus.jobs.put(job_id, GARBAGE)
    await _until(lambda: len(got) == 2)
    assert got[1]["event"] == "error" and "id" not in got[1]
    assert json.loads(got[1]["data"])["message"].startswith(f"job record {job_id} is corrupt")
    # Several record checks that found it corrupt later: still one error event.
    corrupt = checks.count("JobRecordCorrupt")
    await _until(lambda: checks.count("JobRecordCorrupt") >= corrupt + 3)
    assert len(got) == 2 and not follower.done()
    # What a generator does when it meets the bad record: a failed record, one event.
    await publish_event(bus, JobEvent(job_id=job_id, event="failed", status="failed"))
    await asyncio.wait_for(follower, 10)
    assert [e["event"] for e in got] == ["submitted", "error", "failed"]


# --- cancel, kernel ------------------------------------------------------------------


async def test_cancel_pending_job_then_idempotent(client: httpx.AsyncClient, bus: Bus,
                                                  cpu_worker: None, job) -> None:
    job_id = await submit(client, job())
    r = await client.post(f"/api/v1/jobs/{job_id}/cancel")
    assert r.status_code == 200, r.text
    assert (r.json()["status"], r.json()["error"]) == ("cancelled", "cancelled by user")
    assert json.loads((await bus.jobs.get(job_id)).value)["status"] == "cancelled"
    ev = await bus.js.get_last_msg(subjects.STREAM_JOB_EVENTS, subjects.job_events(job_id))
    assert json.loads(ev.data)["event"] == "cancelled"

    again = await client.post(f"/api/v1/jobs/{job_id}/cancel")
    assert again.status_code == 200 and again.json()["status"] == "cancelled"
    info = await bus.js.stream_info(subjects.STREAM_JOB_EVENTS)
    assert info.state.messages == 2  # submitted + one cancelled, not two

    done = await submit(client, job(job_id="done-1"))
    await finish(bus, done, "completed", code="# kernel\n")
    r = await client.post(f"/api/v1/jobs/{done}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "completed"


@pytest.mark.parametrize("job_id", ["job-nope", "a.b", "x" * 65, "*"])
async def test_unknown_or_impossible_job_id_is_404_everywhere(client: httpx.AsyncClient,
                                                             job_id: str) -> None:
    for method, suffix in (("GET", ""), ("GET", "/status"), ("POST", "/cancel"),
                           ("GET", "/kernel"), ("GET", "/events")):
        r = await client.request(method, f"/api/v1/jobs/{job_id}{suffix}")
        assert r.status_code == 404, (method, suffix, r.text)
        assert "no job with id" in r.json()["detail"]


async def test_kernel_404_until_there_is_one_then_python_source(
    client: httpx.AsyncClient, bus: Bus, cpu_worker: None, job
) -> None:
    job_id = await submit(client, job())
    r = await client.get(f"/api/v1/jobs/{job_id}/kernel")
    assert r.status_code == 404 and "no kernel yet" in r.json()["detail"]
    code = "import triton\n\n@triton.jit\ndef relu_kernel(x):\n    pass\n"
    await finish(bus, job_id, "completed", code=code)
    r = await client.get(f"/api/v1/jobs/{job_id}/kernel")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/x-python")
    assert r.text == code
    assert r.headers["x-aikg-passed"] == "true" and r.headers["x-aikg-candidate-id"] == "cand-1"


# --- events (SSE) --------------------------------------------------------------------


async def test_events_of_finished_job_replay_whole_history_and_end(
    client: httpx.AsyncClient, bus: Bus, cpu_worker: None, job
) -> None:
    job_id = await submit(client, job())
    for kind in ("started", "candidate_generated", "verify_started", "verify_result"):
        await publish_event(bus, JobEvent(job_id=job_id, event=kind, status="running"))
    other = await submit(client, job(job_id="other-job"))  # interleaved, must not show up
    await finish(bus, job_id, "completed", code="# k\n")

    async with client.stream("GET", f"/api/v1/jobs/{job_id}/events") as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = await asyncio.wait_for(read_sse(r), 10)
    kinds = [e["event"] for e in events]
    assert kinds == ["submitted", "started", "candidate_generated", "verify_started",
                     "verify_result", "completed"]
    for e in events:
        data = json.loads(e["data"])
        assert data["job_id"] == job_id and data["event"] == e["event"]
        msgspec.json.decode(e["data"], type=JobEvent)
    seqs = [int(e["id"]) for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert other not in json.dumps(events)

    # Resume after the third event: Last-Event-ID is the stream sequence.
    async with client.stream("GET", f"/api/v1/jobs/{job_id}/events",
                             headers={"Last-Event-ID": str(seqs[2])}) as r:
        rest = await asyncio.wait_for(read_sse(r), 10)
    assert [e["event"] for e in rest] == kinds[3:]
    bad = await client.get(f"/api/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "x"})
    assert bad.status_code == 400 and "Last-Event-ID" in bad.json()["detail"]


async def test_events_of_running_job_arrive_live_until_cancel(
    client: httpx.AsyncClient, bus: Bus, cpu_worker: None, job
) -> None:
    job_id = await submit(client, job())
    got: list[dict] = []
    follower = asyncio.create_task(follow_events(client, job_id, got))
    await _until(lambda: len(got) == 1)
    assert got[0]["event"] == "submitted"
    await publish_event(bus, JobEvent(job_id=job_id, event="started", status="running",
                                      message="live one"))
    await _until(lambda: len(got) == 2)
    assert json.loads(got[1]["data"])["message"] == "live one"
    assert not follower.done()
    assert (await client.post(f"/api/v1/jobs/{job_id}/cancel")).status_code == 200
    await asyncio.wait_for(follower, 10)  # the stream ends after the terminal event
    assert [e["event"] for e in got] == ["submitted", "started", "cancelled"]


async def test_events_end_from_record_when_terminal_event_is_missing(
    client: httpx.AsyncClient, bus: Bus, cpu_worker: None, job, monkeypatch
) -> None:
    from services.gateway import events

    monkeypatch.setattr(events, "RECORD_CHECK_S", 0.2)
    monkeypatch.setattr(events, "TERMINAL_GRACE_S", 0.2)
    job_id = await submit(client, job())
    await finish(bus, job_id, "failed", event=False)
    async with client.stream("GET", f"/api/v1/jobs/{job_id}/events") as r:
        got = await asyncio.wait_for(read_sse(r), 10)
    assert [e["event"] for e in got] == ["submitted", "failed"]
    assert "id" not in got[-1]
    assert json.loads(got[-1]["data"])["status"] == "failed"


async def test_events_send_keepalive_comments(client: httpx.AsyncClient, cpu_worker: None,
                                              job, monkeypatch) -> None:
    from services.gateway import events

    monkeypatch.setattr(events, "HEARTBEAT_S", 0.3)
    job_id = await submit(client, job())
    comments = 0
    async with client.stream("GET", f"/api/v1/jobs/{job_id}/events") as r:
        async for line in r.aiter_lines():
            if line.startswith(": keepalive"):
                comments += 1
                if comments == 2:
                    break
    assert comments == 2


async def follow_events(client: httpx.AsyncClient, job_id: str, got: list[dict]) -> None:
    """Appends each event of the job's SSE stream to ``got`` as it arrives."""
    async with httpx.AsyncClient(base_url=str(client.base_url), timeout=scaled(10)) as c:
        async with c.stream("GET", f"/api/v1/jobs/{job_id}/events") as r:
            async for e in _iter_sse(r):
                got.append(e)


async def _iter_sse(response: httpx.Response):
    """Events of a stream as dicts, leaving out ``queued`` ones (the jobs here wait with
    no generator running, so their position is told once)."""
    block: dict = {}
    async for line in response.aiter_lines():
        if line == "":
            if block and "event" in block and block["event"] != "queued":
                yield block
            block = {}
        elif not line.startswith(":"):
            field, _, value = line.partition(":")
            block[field] = value.lstrip(" ")


async def _until(predicate, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + scaled(timeout)
    while not predicate():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


# --- workers -------------------------------------------------------------------------


async def test_workers_show_load_and_leases(client: httpx.AsyncClient, bus: Bus,
                                            fake_worker_heartbeat) -> None:
    await fake_worker_heartbeat(bus, "cpu", "x86_64", worker_id="w-cpu", devices=["0", "1"],
                                capacity=2, in_flight=1)
    await fake_worker_heartbeat(bus, "cuda", "h200", worker_id="w-gpu", devices=["0"], capacity=1)
    await bus.leases.put("w-cpu.1", encode({"worker_id": "w-cpu", "device": "1",
                                            "job_id": "job-a", "request_id": "req-a",
                                            "since": dt.datetime.now(dt.UTC)}))
    for path in ("/api/v1/workers", "/api/v1/workers/status"):
        workers = (await client.get(path)).json()["workers"]
        assert [w["worker_id"] for w in workers] == ["w-cpu", "w-gpu"]
        cpu, gpu = workers
        assert (cpu["capacity"], cpu["in_flight"], cpu["load"]) == (2, 1, 0.5)
        assert [(le["device"], le["job_id"], le["request_id"]) for le in cpu["leases"]] == [
            ("1", "job-a", "req-a")]
        assert (gpu["load"], gpu["leases"]) == (0.0, [])


async def test_new_routes_want_the_token(start_gateway, settings: Settings, bus: Bus,
                                         fake_worker_heartbeat, job) -> None:
    await fake_worker_heartbeat(bus)
    url = await start_gateway(msgspec.structs.replace(settings, api_token="tok"))
    good = {"Authorization": "Bearer tok"}
    async with httpx.AsyncClient(base_url=url, timeout=scaled(10)) as c:
        job_id = (await c.post("/api/v1/jobs", json=job(), headers=good)).json()["job_id"]
        for method, path in (("GET", "/api/v1/jobs"), ("POST", f"/api/v1/jobs/{job_id}/cancel"),
                             ("GET", f"/api/v1/jobs/{job_id}/kernel"),
                             ("GET", f"/api/v1/jobs/{job_id}/events"),
                             ("GET", "/schema/openapi.json")):
            r = await c.request(method, path)
            assert r.status_code == 401, (path, r.status_code)
        assert (await c.get("/api/v1/jobs", headers=good)).json()["total"] == 1


async def test_openapi_lists_every_route(client: httpx.AsyncClient) -> None:
    paths = (await client.get("/schema/openapi.json")).json()["paths"]
    for path in ("/api/v1/jobs", "/api/v1/jobs/submit", "/api/v1/jobs/{job_id}",
                 "/api/v1/jobs/{job_id}/status", "/api/v1/jobs/{job_id}/cancel",
                 "/api/v1/jobs/{job_id}/events", "/api/v1/jobs/{job_id}/kernel",
                 "/api/v1/workers", "/api/v1/workers/status", "/healthz", "/readyz",
                 "/api/v1/verify/batch", "/api/v1/verify/batch/{batch_id}",
                 "/api/v1/verify/batch/{batch_id}/cancel",
                 "/api/v1/verify/batch/{batch_id}/events"):
        assert path in paths, path
    assert "text/event-stream" in json.dumps(paths["/api/v1/jobs/{job_id}/events"])
    assert "text/event-stream" in json.dumps(paths["/api/v1/verify/batch/{batch_id}/events"])


async def test_gateway_stops_promptly_with_an_event_stream_open(
    settings: Settings, bus: Bus, cpu_worker: None, job, monkeypatch
) -> None:
    """An event stream never ends by itself; shutdown cancels it after a grace period."""
    from services.gateway import app as gateway_app

    monkeypatch.setattr(gateway_app, "SHUTDOWN_GRACE_S", 0.5)
    stop = asyncio.Event()
    serving = asyncio.create_task(gateway_app.serve_gateway(settings, stop))
    base = f"http://127.0.0.1:{settings.gateway_port}"
    async with httpx.AsyncClient(base_url=base, timeout=scaled(10)) as c:
        for _ in range(200):
            with contextlib.suppress(httpx.TransportError):
                if (await c.get("/healthz")).status_code == 200:
                    break
            await asyncio.sleep(0.05)
        job_id = await submit(c, job())
        async with c.stream("GET", f"/api/v1/jobs/{job_id}/events") as r:
            assert r.status_code == 200
            stop.set()
            await asyncio.wait_for(serving, 10)


async def test_nats_gone_answers_503_with_retry_after(nats_server, gateway: str) -> None:
    """With the NATS server killed, routes that need it answer 503 (retry), never 500."""
    nats_server.kill()
    async with httpx.AsyncClient(base_url=gateway, timeout=scaled(30)) as client:
        # Wait until the gateway's NATS client has noticed the closed socket.
        for _ in range(500):
            if (await client.get("/readyz")).status_code == 503:
                break
            await asyncio.sleep(0.02)
        else:
            pytest.fail("/readyz still answered 200 10 s after the NATS server was killed")
        for path in ("/api/v1/workers", "/api/v1/jobs/some-job/status", "/api/v1/jobs"):
            t0 = asyncio.get_running_loop().time()
            resp = await client.get(path)
            assert resp.status_code == 503, (path, resp.status_code, resp.text)
            assert resp.headers.get("retry-after")
            # Fails fast while reconnecting instead of waiting out a request timeout.
            assert asyncio.get_running_loop().time() - t0 < 5
        ready = await client.get("/readyz")
        assert ready.status_code == 503
