"""The gateway's routes against a real nats-server: in process over ASGI (the
``app_client`` fixture, Litestar's test client) for the routes, over real HTTP
(uvicorn) where serving itself is tested (readiness, auth, a port in use)."""

from __future__ import annotations

import asyncio
import json

import httpx
import msgspec
import nats.js.errors
import pytest

from schemas import JobEvent, JobSubmit, decode, subjects
from services.common.bus import Bus
from services.common.settings import Settings
from tests import support_gateway

# The gateway tests' fixtures shared with the other gateway test module; the routes run
# in process here, on Litestar's test client.
cpu_worker, job = support_gateway.cpu_worker, support_gateway.job


@pytest.fixture
def client(app_client: httpx.AsyncClient) -> httpx.AsyncClient:
    return app_client


async def test_submit_writes_record_publishes_job_and_event(
    client: httpx.AsyncClient, bus: Bus, cpu_worker: None, job
) -> None:
    r = await client.post("/api/v1/jobs/submit", json=job(shape_overrides={"batch_size": 2}))
    assert r.status_code == 200, r.text
    body = r.json()
    job_id = body["job_id"]
    assert body["status"] == "pending"
    assert (body["backend"], body["arch"]) == ("cpu", "x86_64")

    entry = await bus.jobs.get(job_id)
    record = json.loads(entry.value)
    assert record["status"] == "pending"
    assert record["request"]["shape_overrides"] == {"batch_size": 2}
    assert record["request"]["arch"] == "x86_64"

    msg = await bus.js.get_last_msg(subjects.STREAM_JOBS, subjects.JOBS_SUBMIT)
    assert msg.headers["Nats-Msg-Id"] == job_id
    submitted = decode(msg.data, JobSubmit)
    assert (submitted.job_id, submitted.op_name, submitted.arch) == (job_id, "relu", "x86_64")

    ev = await bus.js.get_last_msg(subjects.STREAM_JOB_EVENTS, subjects.job_events(job_id))
    event = decode(ev.data, JobEvent)
    assert (event.event, event.status) == ("submitted", "pending")


async def test_submit_alias_route(client: httpx.AsyncClient, cpu_worker: None, job) -> None:
    r = await client.post("/api/v1/jobs", json=job())
    assert r.status_code == 200, r.text
    assert r.json()["job_id"].startswith("job-")


async def test_status_returns_reference_fields(
    client: httpx.AsyncClient, cpu_worker: None, job
) -> None:
    job_id = (await client.post("/api/v1/jobs/submit", json=job(job_type="single"))).json()["job_id"]
    for path in (f"/api/v1/jobs/{job_id}/status", f"/api/v1/jobs/{job_id}"):
        r = await client.get(path)
        assert r.status_code == 200, r.text
        record = r.json()
        for name in ("status", "job_type", "op_name", "submit_time", "result", "error"):
            assert name in record
        assert (record["job_id"], record["status"], record["job_type"], record["op_name"]) == (
            job_id, "pending", "single", "relu")
        assert record["result"] is None and record["error"] is None
        assert record["progress"]["phase"] == "queued"


async def test_status_unknown_job_is_404(client: httpx.AsyncClient) -> None:
    r = await client.get("/api/v1/jobs/job-nope/status")
    assert r.status_code == 404
    assert "job-nope" in r.json()["detail"]


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"max_rounds": 0}, ["Expected `int` >= 1", "$.max_rounds"]),
        ({"backend": "tpu"}, ["'tpu'", "$.backend"]),
        ({"task_desc": None}, ["task_desc"]),
        ({"task_desc": "import torch\n\nclass Model(:\n    pass\n"}, ["not valid Python", "line 3"]),
        ({"task_desc": "x = 1\n"}, ["Model", "get_inputs"]),
        ({"unknown_field": 1}, ["unknown_field"]),
    ],
    ids=["max_rounds", "backend", "missing_task_desc", "syntax_error", "not_a_task", "unknown"],
)
async def test_bad_submission_is_400_naming_the_problem(
    client: httpx.AsyncClient, cpu_worker: None, job, fields: dict, words: list[str]
) -> None:
    r = await client.post("/api/v1/jobs/submit", json=job(**fields))
    assert r.status_code == 400, r.text
    detail = r.json()["detail"]
    for word in words:
        assert word in detail


async def test_no_live_worker_is_409_listing_live_pairs(
    client: httpx.AsyncClient, cpu_worker: None, job
) -> None:
    r = await client.post("/api/v1/jobs/submit", json=job(backend="cuda", arch="h200"))
    assert r.status_code == 409
    assert r.json()["live"] == ["cpu/x86_64"]
    assert "no live worker for backend=cuda arch=h200" in r.json()["detail"]

    r = await client.post("/api/v1/jobs/submit", json=job(backend="cpu", arch="aarch64"))
    assert r.status_code == 409
    assert r.json()["live"] == ["cpu/x86_64"]


async def test_no_worker_at_all_is_409(client: httpx.AsyncClient, job) -> None:
    r = await client.post("/api/v1/jobs/submit", json=job())
    assert r.status_code == 409
    assert r.json()["live"] == []


async def test_client_job_id_resubmit_is_idempotent(
    client: httpx.AsyncClient, bus: Bus, cpu_worker: None, job
) -> None:
    first = await client.post("/api/v1/jobs/submit", json=job(job_id="my-job-1"))
    again = await client.post("/api/v1/jobs/submit", json=job(job_id="my-job-1"))
    assert first.status_code == again.status_code == 200
    assert first.json()["job_id"] == again.json()["job_id"] == "my-job-1"
    # The resubmit's copy of the message is dropped by the stream's dedupe window.
    assert (await bus.js.stream_info(subjects.STREAM_JOBS)).state.messages == 1
    other = await client.post("/api/v1/jobs/submit", json=job(job_id="my-job-1", max_rounds=3))
    assert other.status_code == 409
    assert "is taken" in other.json()["detail"] and "status" not in other.json()["detail"]


async def test_body_over_limit_is_413(client: httpx.AsyncClient, job) -> None:
    r = await client.post("/api/v1/jobs/submit", json=job(task_desc="#" * (3 << 20)))
    assert r.status_code == 413
    assert "bytes" in r.json()["detail"]


async def test_workers_route_lists_live_workers(client: httpx.AsyncClient, bus: Bus,
                                                fake_worker_heartbeat) -> None:
    await fake_worker_heartbeat(bus, "cpu", "x86_64", devices=["0", "1"], capacity=2)
    await fake_worker_heartbeat(bus, "cuda", "h200", worker_id="gpu-1")
    for path in ("/api/v1/workers/status", "/api/v1/workers"):
        workers = (await client.get(path)).json()["workers"]
        assert {(w["backend"], w["arch"]) for w in workers} == {("cpu", "x86_64"), ("cuda", "h200")}
        cpu = next(w for w in workers if w["backend"] == "cpu")
        assert (cpu["devices"], cpu["capacity"]) == (["0", "1"], 2)


async def test_probes_metrics_and_schema(client: httpx.AsyncClient, cpu_worker: None) -> None:
    assert (await client.get("/healthz")).json() == {"status": "ok"}
    assert (await client.get("/readyz")).status_code == 200
    await client.get("/api/v1/jobs/job-x/status")
    text = (await client.get("/metrics")).text
    assert 'aikg_gateway_requests_total{method="GET",route="/api/v1/jobs/{job_id}/status",status="404"}' in text
    assert "job-x" not in text
    assert "aikg_gateway_submit_seconds" in text
    schema = (await client.get("/schema/openapi.json")).json()
    assert "/api/v1/jobs/submit" in schema["paths"]
    assert "JobSubmit" in json.dumps(schema["components"])


async def test_readyz_is_503_when_nats_is_gone(nats_server, start_gateway, settings: Settings) -> None:
    url = await start_gateway(settings)
    async with httpx.AsyncClient(base_url=url) as c:
        assert (await c.get("/readyz")).status_code == 200
        nats_server.kill()
        for _ in range(50):
            r = await c.get("/readyz")
            if r.status_code == 503:
                break
            await asyncio.sleep(0.1)
        assert r.status_code == 503
        assert r.json()["reason"]
        assert (await c.get("/healthz")).status_code == 200


async def test_api_token(
    start_gateway, settings: Settings, bus: Bus, fake_worker_heartbeat, job
) -> None:
    await fake_worker_heartbeat(bus)
    url = await start_gateway(msgspec.structs.replace(settings, api_token="s3cret"))
    async with httpx.AsyncClient(base_url=url) as c:
        assert (await c.get("/healthz")).status_code == 200
        assert (await c.get("/readyz")).status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = await c.post("/api/v1/jobs/submit", json=job(), headers=headers)
            assert r.status_code == 401
            assert "AIKG_API_TOKEN" in r.json()["detail"]
            assert (await c.get("/api/v1/workers", headers=headers)).status_code == 401
            assert (await c.get("/metrics", headers=headers)).status_code == 401
        good = {"Authorization": "Bearer s3cret"}
        assert (await c.post("/api/v1/jobs/submit", json=job(), headers=good)).status_code == 200
        assert (await c.get("/api/v1/workers", headers=good)).status_code == 200


async def test_api_token_wrong_value_of_any_length_is_401(
    start_gateway, settings: Settings, bus: Bus, fake_worker_heartbeat, job
) -> None:
    """The token is compared in constant time (hmac.compare_digest); a wrong token of
    the right length, of another length, in another case or with non-ASCII bytes is
    refused alike, never a 500."""
    from services.gateway.app import _token_matches

    await fake_worker_heartbeat(bus)
    url = await start_gateway(msgspec.structs.replace(settings, api_token="s3cret"))
    wrong = [b"Bearer s3creT", b"Bearer s3cre", b"Bearer s3cret-and-more", b"bearer s3cret",
             b"Bearer s\xe9cret", b"s3cret", b"Bearer"]
    assert len(wrong[0]) == len(b"Bearer s3cret")  # same length, one byte differs
    async with httpx.AsyncClient(base_url=url) as c:
        for value in wrong:
            r = await c.get("/api/v1/jobs", headers=[(b"Authorization", value)])
            assert r.status_code == 401, (value, r.text)
            assert "AIKG_API_TOKEN" in r.json()["detail"]
        good = await c.get("/api/v1/jobs", headers={"Authorization": "Bearer s3cret"})
        assert good.status_code == 200
    assert _token_matches("Bearer s3cret", b"Bearer s3cret")
    assert not _token_matches("Bearer s\udcffcret", b"Bearer s3cret")  # no TypeError


@pytest.mark.parametrize(
    ("fields", "path", "expected"),
    [
        ({"max_rounds": "3"}, "$.max_rounds", "Expected `int`, got `str`"),
        ({"max_attempts": 2.0}, "$.max_attempts", "Expected `int`, got `float`"),
        ({"parent_selection_prob": "0.5"}, "$.parent_selection_prob",
         "Expected `float`, got `str`"),
        ({"timeout_s": "30"}, "$.timeout_s", "Expected `float`, got `str`"),
        ({"shape_overrides": {"batch_size": 2}, "trials": "2"}, "$.trials",
         "Expected `int`, got `str`"),
    ],
    ids=["int_as_str", "int_as_float", "float_as_str", "timeout_as_str", "trials_as_str"],
)
async def test_numbers_in_strings_are_400_naming_the_field(
    client: httpx.AsyncClient, bus: Bus, cpu_worker: None, job, fields: dict, path: str,
    expected: str,
) -> None:
    r = await client.post("/api/v1/jobs/submit", json=job(job_id="strict-1", **fields))
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["detail"] == f"invalid request: {expected} - at `{path}`"
    assert body["errors"][0]["key"] == path.removeprefix("$.")
    with pytest.raises(nats.js.errors.KeyNotFoundError):  # nothing was recorded
        await bus.jobs.get("strict-1")


async def test_integer_for_a_float_field_is_accepted(
    client: httpx.AsyncClient, cpu_worker: None, job
) -> None:
    """msgspec's strict mode still takes an int where a float is wanted (JSON has one
    number type and ``30`` is a fine ``timeout_s``)."""
    r = await client.post("/api/v1/jobs/submit", json=job(timeout_s=30, parent_selection_prob=1))
    assert r.status_code == 200, r.text


async def test_serve_gateway_fails_clearly_on_port_in_use(gateway: str, settings: Settings) -> None:
    from services.gateway.app import serve_gateway

    with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{settings.gateway_port}"):
        await serve_gateway(settings, asyncio.Event())


async def test_serve_gateway_fails_clearly_without_nats(
    settings: Settings, free_port, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.common import bus as bus_module
    from services.gateway.app import serve_gateway

    monkeypatch.setattr(bus_module, "FIRST_CONNECT_TIMEOUT_S", 1.0)
    bad = msgspec.structs.replace(settings, nats_url=f"nats://127.0.0.1:{free_port()}")
    with pytest.raises(ConnectionError, match="cannot reach NATS"):
        await serve_gateway(bad, asyncio.Event())


async def test_create_app_connects_and_closes_its_own_bus(settings: Settings) -> None:
    from litestar.testing import AsyncTestClient

    from services.gateway.app import create_app

    app = create_app(settings)
    async with AsyncTestClient(app) as c:
        assert (await c.get("/readyz")).json() == {"status": "ok"}
        own = app.state.bus
        assert own.nc.is_connected
    assert own.nc.is_closed
