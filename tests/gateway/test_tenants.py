"""Tenants, their limits, fair scheduling across them, and queue positions.

Real parts throughout: a nats-server per test, the gateway over HTTP, a generator
and a worker in this event loop. Jobs that must only *start* use a generator whose
verdict wait is short and no worker for their lane, so each started job fails
quickly and the order of starts is what is measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from rich.console import Console

from schemas import JobRecord, JobResult, VerifyResult, decode, subjects
from services.cli.render import jobs_table, record_view
from services.common.bus import Bus
from services.common.runtime import cancel_and_wait
from services.common.settings import Settings
from services.common.tenants import hash_token, load_tenants
from services.gateway.queue import fair_positions
from services.generator.service import run_generator
from services.sdk.client import AsyncAIKGClient
from services.worker.service import Worker
from tests.conftest import lend_verifier
from tests.helpers import RELU_KERNEL, RELU_TASK, scaled, started_generator_pull

TOKENS = {"team_a": "tok-a", "team_b": "tok-b", "team_c": "tok-c"}


def tenants_file(tmp_path: Path, **extra: dict[str, Any]) -> str:
    """A tenants file with team_a (30 in flight), team_b and team_c (may use high)."""
    entries = {"team_a": {"max_in_flight": 30}, "team_b": {},
               "team_c": {"max_priority": "high", "max_jobs_per_hour": 2,
                          "max_parallel_num": 4}}
    for name, values in extra.items():
        entries.setdefault(name, {}).update(values)
    lines = []
    for name, values in entries.items():
        lines.append(f"[tenants.{name}]")
        lines.append(f'token_sha256 = "{hash_token(TOKENS[name])}"')
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    path = tmp_path / "tenants.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def job(job_id: str, **fields: Any) -> dict[str, Any]:
    return {"op_name": "relu", "task_desc": RELU_TASK, "init_code": RELU_KERNEL,
            "backend": "cpu", "job_id": job_id, "max_attempts": 1, "trials": 1, **fields}


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[tenant]}"}


@contextlib.asynccontextmanager
async def gateway(start_gateway, settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    url = await start_gateway(settings)
    async with httpx.AsyncClient(base_url=url, timeout=scaled(15)) as client:
        yield client


# --- configuration ------------------------------------------------------------------


def test_tenants_file_errors_name_the_entry(tmp_path: Path, settings: Settings) -> None:
    bad = tmp_path / "bad.toml"
    for text, words in [
        ('[tenants.team-a]\ntoken_sha256 = "00"\n', "tenant name 'team-a'"),
        ('[tenants.a]\ntoken_sha256 = "xyz"\n', "64 hex digits"),
        ('[tenants.a]\nmax_in_flight = -1\n', "max_in_flight = -1"),
        ('[tenants.a]\nmax_priority = "urgent"\n', "max_priority = 'urgent'"),
        ('[tenants.a]\nmax_inflight = 3\n', "unknown key(s) max_inflight"),
        (f'[tenants.a]\ntoken_sha256 = "{"0" * 64}"\n[tenants.b]\ntoken_sha256 = "{"0" * 64}"\n',
         "the same token"),
        ("[tenants.a\n", "not valid TOML"),
    ]:
        bad.write_text(text)
        with pytest.raises(ValueError) as info:
            load_tenants(msgspec.structs.replace(settings, tenants_file=str(bad)))
        assert words in str(info.value), (text, str(info.value))
    with pytest.raises(ValueError, match="cannot be read"):
        load_tenants(msgspec.structs.replace(settings, tenants_file=str(tmp_path / "none")))


def test_api_token_is_the_default_tenant_and_tokens_are_hashed(tmp_path: Path,
                                                              settings: Settings) -> None:
    table = load_tenants(msgspec.structs.replace(settings, api_token="old-token",
                                                 tenants_file=tenants_file(tmp_path)))
    assert table.authenticate("Bearer old-token").name == "default"
    assert table.authenticate("Bearer tok-b").name == "team_b"
    for wrong in ("Bearer tok-", "bearer tok-b", "tok-b", "", "Bearer tok-b "):
        assert table.authenticate(wrong) is None, wrong
    assert all("tok-" not in repr(t) for t in table.tenants.values())
    assert not load_tenants(settings).auth  # neither file nor token: no auth, one tenant


def test_positions_follow_priority_then_tenants_in_turn() -> None:
    lanes = {("a", "normal"): ["a1", "a2", "a3"], ("b", "normal"): ["b1"],
             ("c", "high"): ["c1"], ("d", "low"): ["d1"]}
    pos = fair_positions(lanes)
    assert pos["c1"] == 1  # high first
    assert pos["a1"] == 3 and pos["b1"] == 3  # either may go first in the round
    assert pos["a2"] == 4 and pos["a3"] == 5 and pos["d1"] == 6


# --- limits -------------------------------------------------------------------------


async def test_limits_answer_429_or_403_naming_the_limit(
        tmp_path: Path, settings: Settings, bus: Bus, fake_worker_heartbeat,
        start_gateway) -> None:
    await fake_worker_heartbeat(bus)
    settings = msgspec.structs.replace(settings, tenants_file=tenants_file(tmp_path))
    async with gateway(start_gateway, settings) as client:
        assert (await client.post("/api/v1/jobs/submit", json=job("x"))).status_code == 401
        r = await client.post("/api/v1/jobs/submit", headers=auth("team_c"),
                              json=job("c-1", priority="high"))
        assert r.status_code == 200, r.text
        record = (await client.get("/api/v1/jobs/c-1/status", headers=auth("team_c"))).json()
        assert (record["tenant"], record["priority"]) == ("team_c", "high")
        msg = await bus.js.get_last_msg(subjects.STREAM_JOBS, "jobs.submit.team_c.high")
        assert msg.headers["Nats-Msg-Id"] == "c-1"

        r = await client.post("/api/v1/jobs/submit", headers=auth("team_c"),
                              json=job("c-2", parallel_num=5))
        assert r.status_code == 403 and "max_parallel_num" in r.json()["detail"], r.text
        assert "Retry-After" not in r.headers
        r = await client.post("/api/v1/jobs/submit", headers=auth("team_b"),
                              json=job("b-1", priority="high"))
        assert r.status_code == 403 and "max_priority" in r.json()["detail"], r.text

        assert (await client.post("/api/v1/jobs/submit", headers=auth("team_c"),
                                  json=job("c-2"))).status_code == 200
        r = await client.post("/api/v1/jobs/submit", headers=auth("team_c"), json=job("c-3"))
        assert r.status_code == 429, r.text
        body = r.json()
        assert body["limit"] == "max_jobs_per_hour" and "max_jobs_per_hour" in body["detail"]
        assert 1 <= int(r.headers["Retry-After"]) <= 3600
        # A resubmit of an accepted job is idempotent, limits or not.
        again = await client.post("/api/v1/jobs/submit", headers=auth("team_c"), json=job("c-2"))
        assert again.status_code == 200 and again.json()["message"] == "job already submitted"
        metrics = (await client.get("/metrics", headers=auth("team_c"))).text
        assert 'aikg_gateway_rejections_total{limit="max_jobs_per_hour",tenant="team_c"} 1.0' \
            in metrics
        assert 'aikg_gateway_jobs_submitted_total{priority="high",tenant="team_c"} 1.0' in metrics


async def test_a_tenant_sees_and_acts_on_its_own_jobs_only(
        tmp_path: Path, settings: Settings, bus: Bus, fake_worker_heartbeat,
        start_gateway) -> None:
    await fake_worker_heartbeat(bus)
    settings = msgspec.structs.replace(settings, tenants_file=tenants_file(tmp_path),
                                       api_token="operator-token")
    operator = {"Authorization": "Bearer operator-token"}
    async with gateway(start_gateway, settings) as client:
        for tenant, job_id in (("team_a", "a-own"), ("team_b", "b-own")):
            r = await client.post("/api/v1/jobs/submit", headers=auth(tenant), json=job(job_id))
            assert r.status_code == 200, r.text
        # team_b cannot tell team_a's job from one that does not exist.
        for method, path in (("GET", "/api/v1/jobs/a-own/status"), ("GET", "/api/v1/jobs/a-own"),
                             ("GET", "/api/v1/jobs/a-own/kernel"),
                             ("GET", "/api/v1/jobs/a-own/events"),
                             ("POST", "/api/v1/jobs/a-own/cancel")):
            r = await client.request(method, path, headers=auth("team_b"))
            assert r.status_code == 404, (method, path, r.text)
            assert r.json() == (await client.request(
                method, path.replace("a-own", "nobody"), headers=auth("team_b"))).json() | {
                "detail": r.json()["detail"]}
        assert (await client.get("/api/v1/jobs/a-own/status",
                                 headers=auth("team_a"))).json()["status"] == "pending"
        listed = (await client.get("/api/v1/jobs", headers=auth("team_b"))).json()
        assert [j["job_id"] for j in listed["jobs"]] == ["b-own"] and listed["total"] == 1
        other = (await client.get("/api/v1/jobs", params={"tenant": "team_a"},
                                  headers=auth("team_b"))).json()
        assert other["jobs"] == [] and other["total"] == 0
        # Both jobs end with a kernel; each tenant's export holds its own only.
        for job_id in ("a-own", "b-own"):
            entry = await bus.jobs.get(job_id)
            record = decode(entry.value, JobRecord)
            record.status = "completed"
            record.end_time = dt.datetime.now(dt.UTC)
            record.result = JobResult(passed=True, code=RELU_KERNEL, candidate_id=f"{job_id}-c1")
            await bus.jobs.update(job_id, msgspec.json.encode(record), last=entry.revision)
        for tenant, own in (("team_a", "a-own"), ("team_b", "b-own")):
            rows = (await client.get("/api/v1/kernels", headers=auth(tenant))).json()["kernels"]
            assert [r["job_id"] for r in rows] == [own], tenant
        rows = (await client.get("/api/v1/kernels", headers=operator)).json()["kernels"]
        assert {r["job_id"] for r in rows} == {"a-own", "b-own"}
        assert (await client.get("/api/v1/jobs/a-own/kernel", headers=auth("team_b"))
                ).status_code == 404
        # The operator (AIKG_API_TOKEN) sees every tenant's jobs, and may cancel them.
        everyone = (await client.get("/api/v1/jobs", headers=operator)).json()
        assert {j["job_id"] for j in everyone["jobs"]} == {"a-own", "b-own"}
        assert (await client.post("/api/v1/jobs/submit", headers=auth("team_a"),
                                  json=job("a-two"))).status_code == 200
        r = await client.post("/api/v1/jobs/a-two/cancel", headers=operator)
        assert r.status_code == 200 and r.json()["status"] == "cancelled"


# --- fair order on the bus ----------------------------------------------------------


async def test_lane_pull_takes_high_first_then_tenants_in_turn(bus: Bus) -> None:
    for tenant, priority, n in (("team_a", "normal", 3), ("team_b", "normal", 1),
                                ("team_c", "high", 1)):
        for i in range(n):
            await bus.js.publish(subjects.job_submit(tenant, priority), b"{}",
                                 headers={"Nats-Msg-Id": f"{tenant}-{i}"})
    await bus.js.publish(subjects.JOBS_SUBMIT, b"{}", headers={"Nats-Msg-Id": "raw-0"})
    pull = await started_generator_pull(bus)
    order: list[str] = []
    try:
        for _ in range(7):
            taken: list[Any] = []
            await pull.fetch(1, taken.append)
            for msg in taken:
                order.append(msg.headers["Nats-Msg-Id"])
                await msg.ack()
    finally:
        await pull.stop()
    # high first; then default, team_a, team_b in turn; team_a's rest last.
    assert order[0] == "team_c-0"
    assert set(order[1:4]) == {"raw-0", "team_a-0", "team_b-0"}, order
    assert order[4:] == ["team_a-1", "team_a-2"], order


@pytest.mark.timeout(180)
async def test_worker_serves_verify_lanes_in_turn(bus: Bus, settings: Settings,
                                                  shared_verifier) -> None:
    """Five requests of team_a, then one of team_b, on a one-device worker: team_b's
    is run second, not sixth."""
    arch = settings.arch
    for i, tenant in enumerate(["team_a"] * 5 + ["team_b"]):
        body = {"request_id": f"r{i}-{tenant}", "job_id": f"job-{tenant}",
                "candidate_id": f"c{i}", "op_name": "relu", "task_desc": RELU_TASK,
                "code": RELU_KERNEL, "backend": "cpu", "arch": arch, "trials": 1,
                "tenant": tenant}
        await bus.js.publish(subjects.verify_lane("cpu", arch, tenant, "normal"),
                             json.dumps(body).encode(), headers={"Nats-Msg-Id": body["request_id"]})
    finished: list[VerifyResult] = []

    async def on_result(msg) -> None:
        finished.append(decode(msg.data, VerifyResult))

    sub = await bus.nc.subscribe(f"{subjects.RESULTS_PREFIX}.>", cb=on_result)
    settings = msgspec.structs.replace(settings, worker_devices="0")
    worker = Worker(bus, settings, verifier=lend_verifier(shared_verifier, settings.worker_id))
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        for _ in range(1200):
            if len(finished) >= 2 or task.done():
                break
            await asyncio.sleep(0.1)
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
        await sub.unsubscribe()
    assert len(finished) >= 2, finished
    assert [r.passed for r in finished[:2]] == [True, True], [r.error for r in finished]
    assert "r5-team_b" in [r.request_id for r in finished[:2]], \
        [r.request_id for r in finished]


# --- the acceptance scenario ---------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_burst_of_one_tenant_does_not_hold_up_another(
        tmp_path: Path, settings: Settings, bus: Bus, fake_worker_heartbeat,
        start_gateway) -> None:
    """team_a submits 30 jobs, then team_b one: team_b's starts before team_a's fifth;
    team_a's 31st is over its in-flight limit (429, Retry-After); queue positions only
    go down while a job waits, and are gone once it has started."""
    await fake_worker_heartbeat(bus)
    settings = msgspec.structs.replace(
        settings, tenants_file=tenants_file(tmp_path), generator_concurrency=1,
        verify_result_timeout_s=0.3)
    async with gateway(start_gateway, settings) as client:
        a_ids = [f"a-{i:02d}" for i in range(30)]
        for job_id in a_ids:
            r = await client.post("/api/v1/jobs/submit", headers=auth("team_a"), json=job(job_id))
            assert r.status_code == 200, r.text
        r = await client.post("/api/v1/jobs/submit", headers=auth("team_b"), json=job("b-00"))
        assert r.status_code == 200, r.text
        r = await client.post("/api/v1/jobs/submit", headers=auth("team_a"), json=job("a-30"))
        assert r.status_code == 429, r.text
        assert r.json()["limit"] == "max_in_flight" and "max_in_flight" in r.json()["detail"]
        assert int(r.headers["Retry-After"]) >= 1

        async def status(job_id: str) -> dict[str, Any]:
            owner = "team_b" if job_id.startswith("b-") else "team_a"
            return (await client.get(f"/api/v1/jobs/{job_id}/status",
                                     headers=auth(owner))).json()

        last = await status("a-29")
        assert last["queue_position"] == 31 and last["estimated_start_time"] is None
        listed = (await client.get("/api/v1/jobs", headers=auth("team_b"),
                                   params={"tenant": "team_b"})).json()
        assert [(j["job_id"], j["queue_position"]) for j in listed["jobs"]] == [("b-00", 2)]
        # What `aikg list` and `aikg status` print, and the SDK's view.
        console = Console(width=200, record=True)
        console.print(jobs_table(listed))
        console.print(record_view(decode(json.dumps(last), JobRecord)))
        shown = console.export_text()
        assert "position 2 in the queue" in shown and "position 31 in the queue" in shown
        sdk = AsyncAIKGClient(str(client.base_url), token=TOKENS["team_b"])
        try:
            assert await sdk.get_queue_position("b-00") == (2, None)
        finally:
            await sdk.aclose()

        queued: list[int] = []

        async def follow() -> None:
            async with client.stream("GET", "/api/v1/jobs/a-29/events",
                                     headers=auth("team_a")) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data:") and '"event":"queued"' in line:
                        queued.append(json.loads(line[5:])["data"]["queue_position"])

        follower = asyncio.create_task(follow())
        stop = asyncio.Event()
        generator = asyncio.create_task(run_generator(settings, stop))
        seen: dict[str, list[int | None]] = {"b-00": [], "a-29": []}
        try:
            for _ in range(1200):
                if generator.done():
                    generator.result()
                for job_id in seen:
                    seen[job_id].append((await status(job_id))["queue_position"])
                fifth = await status(a_ids[4])
                if fifth["start_time"] is not None and seen["b-00"][-1] is None:
                    break
                await asyncio.sleep(0.1)
            b, fifth = await status("b-00"), await status(a_ids[4])
        finally:
            stop.set()
            await cancel_and_wait(follower)
            await asyncio.wait_for(generator, 60)

    assert b["start_time"] is not None and fifth["start_time"] is not None, (b, fifth)
    assert dt.datetime.fromisoformat(b["start_time"]) < dt.datetime.fromisoformat(
        fifth["start_time"]), (b["start_time"], fifth["start_time"])
    for job_id, positions in seen.items():
        waiting = [p for p in positions if p is not None]
        assert waiting == sorted(waiting, reverse=True), (job_id, positions)
    assert seen["b-00"][-1] is None and b["queue_position"] is None
    assert seen["a-29"][0] == 31 and min(p for p in seen["a-29"] if p) < 31, seen["a-29"]
    assert queued and queued == sorted(set(queued), reverse=True), queued


def test_token_hash_helper_reads_stdin_not_argv() -> None:
    import subprocess
    import sys

    helper = [sys.executable, "-m", "services.common.tenants"]
    hashed = subprocess.run(helper, input="tok-a\n", capture_output=True, text=True)
    assert hashed.returncode == 0 and hashed.stdout.strip() == hash_token("tok-a")
    helped = subprocess.run([*helper, "--help"], capture_output=True, text=True)
    assert helped.returncode == 0 and "standard input" in helped.stdout
    assert hash_token("--help") not in helped.stdout
    empty = subprocess.run(helper, input="", capture_output=True, text=True)
    assert empty.returncode == 2 and "no token on standard input" in empty.stderr
