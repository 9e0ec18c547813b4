"""Fair shares between tenants, tenant timeout caps, task-code hangs named after the
task, and the resource limits of every sandboxed child.

Real parts: a nats-server per test, the gateway over HTTP, generators and workers in
this event loop, sandboxed children forked from real fork servers. Hangs use
``time.sleep`` (no CPU burnt on a shared CI machine) and short hang limits set
through the settings.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path

import httpx
import msgspec
import pytest

from schemas import VerifyRequest, encode, subjects
from services.common.bus import Bus
from services.common.nats_auth import BusCredentials
from services.common.settings import Settings
from services.common.shares import TenantSlots, share_slots
from services.common.tenants import hash_token, load_tenants
from services.common.verdicts import VerdictWaiter
from services.generator.coders.errors import LoweringError
from services.generator.coders.lowering_role import lower_in_sandbox
from services.sandbox.limits import ChildLimits, child_limits_from
from services.worker.service import run_worker
from services.worker.verifier import Verifier
from tests import helpers
from tests.conftest import TEST_WORKER_IDS
from tests.helpers import RELU_KERNEL, RELU_TASK, scaled, wait_terminal

TOKENS = {"team_a": "tok-a", "team_b": "tok-b"}


def tenants_toml(tmp_path: Path, **entries: dict) -> str:
    lines = []
    for name in TOKENS:
        lines.append(f"[tenants.{name}]")
        lines.append(f'token_sha256 = "{hash_token(TOKENS[name])}"')
        lines += [f"{k} = {json.dumps(v)}" for k, v in entries.get(name, {}).items()]
    path = tmp_path / "tenants.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[tenant]}"}


# A task whose own code hangs: Model construction sleeps (no CPU used).
HANG_IN_MODEL = RELU_TASK.replace("super().__init__()", "super().__init__()\n"
                                  "        import time\n        time.sleep(600)")
# A task whose get_inputs allocates 10 GB outside torch (fake tensors cannot see it).
ALLOC_10GB = RELU_TASK.replace("def get_inputs():", "def get_inputs():\n"
                               "    _blob = bytearray(10 * 10**9)")
assert HANG_IN_MODEL != RELU_TASK and ALLOC_10GB != RELU_TASK


def request(task: str, request_id: str, *, tenant: str = "default", job_id: str = "fair",
            timeout_s: float = 120.0) -> VerifyRequest:
    return VerifyRequest(request_id=request_id, job_id=job_id, candidate_id=request_id,
                         op_name="relu", task_desc=task, code=RELU_KERNEL, backend="cpu",
                         arch="x86_64", trials=1, timeout_s=timeout_s, tenant=tenant)


# ------------------------------------------------------------------ shares and settings


def test_share_slots_rounds_down_but_never_to_zero() -> None:
    assert [share_slots(0.5, n) for n in (0, 1, 2, 3, 4, 8)] == [1, 1, 1, 1, 2, 4]
    assert share_slots(1.0, 4) == 4 and share_slots(0.01, 100) == 1


async def test_tenant_slots_hold_a_tenant_at_its_share_while_others_get_in() -> None:
    slots = TenantSlots(4, lambda tenant: 0.5, "lowering")
    entered: list[str] = []
    release = asyncio.Event()

    async def use(tenant: str) -> None:
        async with slots.hold(tenant):
            entered.append(tenant)
            await release.wait()

    tasks = [asyncio.create_task(use("a")) for _ in range(4)]
    await asyncio.sleep(0.05)
    tasks.append(asyncio.create_task(use("b")))
    await asyncio.sleep(0.05)
    assert entered == ["a", "a", "b"]  # a holds its two slots; b got in at once
    assert slots.at_share("a") and not slots.at_share("b")
    release.set()
    await asyncio.gather(*tasks)
    assert entered.count("a") == 4 and slots.in_use() == 0


async def test_lane_pull_excludes_and_defers_tenants_at_their_share(bus: Bus) -> None:
    for tenant, n in (("team_a", 3), ("team_b", 1)):
        for i in range(n):
            await bus.js.publish(subjects.job_submit(tenant, "normal"), b"{}",
                                 headers={"Nats-Msg-Id": f"{tenant}-{i}"})
    pull = await helpers.started_generator_pull(bus)
    taken: list = []
    try:
        # Excluded: never asked, even with nothing else to take.
        assert await pull.fetch(2, taken.append, exclude=lambda t: t == "team_a") == 1
        assert [m.headers["Nats-Msg-Id"] for m in taken] == ["team_b-0"]
        assert await pull.fetch(2, taken.append, exclude=lambda t: t == "team_a") == 0
        # Deferred: asked once the other lanes came up empty.
        assert await pull.fetch(2, taken.append, defer=lambda t: t == "team_a") == 2
        assert [m.headers["Nats-Msg-Id"] for m in taken[1:]] == ["team_a-0", "team_a-1"]
    finally:
        for msg in taken:
            await msg.ack()
        await pull.stop()


def test_tenant_share_and_timeout_keys_are_checked(tmp_path: Path, settings: Settings) -> None:
    path = tenants_toml(tmp_path, team_a={"max_generator_share": 0.25, "max_timeout_s": 30})
    table = load_tenants(msgspec.structs.replace(settings, tenants_file=path))
    assert table.get("team_a").max_generator_share == 0.25
    assert table.get("team_a").max_timeout_s == 30
    # Unlisted keys take the AIKG_TENANT_* defaults.
    assert table.get("team_b").max_device_share == settings.tenant_max_device_share == 0.5
    assert table.get("team_b").max_generator_share == 0.75
    assert table.get("team_b").max_timeout_s == 600
    for bad, words in (({"max_device_share": 0}, "max_device_share = 0 must be a fraction"),
                       ({"max_generator_share": 1.5}, "max_generator_share = 1.5"),
                       ({"max_timeout_s": -1}, "max_timeout_s = -1 must be a number")):
        path = tenants_toml(tmp_path, team_a=bad)
        with pytest.raises(ValueError, match=words):
            load_tenants(msgspec.structs.replace(settings, tenants_file=path))


def test_child_limits_table_names_each_setting(settings: Settings) -> None:
    limits = child_limits_from(msgspec.structs.replace(
        settings, sandbox_reference_address_space_bytes=1 << 30, sandbox_candidate_cpu_s=7))
    space = limits.address_space("reference", "cpu")
    assert space.value == 1 << 30
    assert space.note == "AIKG_SANDBOX_REFERENCE_ADDRESS_SPACE_BYTES=1073741824 (1.0 GiB)"
    assert limits.address_space("reference", "cuda").value is None  # cpu only
    assert limits.cpu_seconds("replay", 100).value == 7  # the replayer has the candidate's row
    assert limits.cpu_seconds("lower", 100, cores=1).value == 110  # derived: wall + 10 s
    derived = limits.address_space("candidate", "cpu", derived=3 << 30)
    assert derived.value == 3 << 30 and "AIKG_SANDBOX_CANDIDATE_ADDRESS_SPACE_BYTES is 0" in \
        derived.note
    with pytest.raises(ValueError, match="AIKG_SANDBOX_LOWER_CPU_S=-1"):
        child_limits_from(msgspec.structs.replace(settings, sandbox_lower_cpu_s=-1))


# ------------------------------------------------------------------ reference child


@pytest.fixture(scope="module")
def short_verifier(tmp_path_factory):
    """A verifier whose calls into the task's code may last 3 s each."""
    v = Verifier("cpu", worker_id="fair-test", memory_limit_bytes=64 << 20,
                 scratch_root=tmp_path_factory.mktemp("fair-verifier"), task_timeout_s=3.0,
                 child_limits=ChildLimits(reference_address_space_bytes=2 << 30))
    v.start()
    yield v
    v.close()


@pytest.mark.slow  # a verifier of its own, waits out a hang
async def test_a_hang_in_the_tasks_model_is_named_after_the_task(short_verifier) -> None:
    started = time.monotonic()
    result = await short_verifier.verify(request(HANG_IN_MODEL, "hang-ref"), device="0")
    elapsed = time.monotonic() - started
    assert result.stage == "task", result
    assert result.error.startswith("the task's Model(*get_init_inputs()) did not finish in "
                                   "3 s (setting AIKG_TASK_TIMEOUT_S)"), result.error
    assert "shape_overrides" not in result.error and "infrastructure" not in result.error
    assert elapsed < 60, elapsed  # the 3 s limit, not the request's 120 s


async def test_a_10gb_allocation_in_get_inputs_fails_in_seconds_naming_the_limit(
        short_verifier) -> None:
    started = time.monotonic()
    result = await short_verifier.verify(request(ALLOC_10GB, "alloc-ref"), device="0")
    assert result.stage == "task", result
    assert "MemoryError" in result.error and "get_inputs()" in result.error, result.error
    assert "AIKG_SANDBOX_REFERENCE_ADDRESS_SPACE_BYTES=2147483648 (2.0 GiB)" in result.error
    assert time.monotonic() - started < 30


# ------------------------------------------------------------------ lowering child


@pytest.mark.slow  # a lowering sandbox of its own
async def test_a_10gb_allocation_while_lowering_fails_in_seconds_naming_the_limit(
        lowering_sandbox) -> None:
    started = time.monotonic()
    with pytest.raises(LoweringError) as failed:
        await lower_in_sandbox(lowering_sandbox, ALLOC_10GB, timeout_s=60,
                             limits=ChildLimits(lower_address_space_bytes=2 << 30))
    assert "MemoryError" in str(failed.value)
    assert "AIKG_SANDBOX_LOWER_ADDRESS_SPACE_BYTES=2147483648 (2.0 GiB)" in str(failed.value)
    assert time.monotonic() - started < 30


async def test_a_hang_while_lowering_is_named_after_the_task(lowering_sandbox) -> None:
    with pytest.raises(LoweringError) as failed:
        await lower_in_sandbox(lowering_sandbox, HANG_IN_MODEL, timeout_s=3)
    assert str(failed.value).startswith(
        "the task's Model(*get_init_inputs()) did not finish in 3 s (setting "
        "AIKG_LOWERING_TIMEOUT_S)"), failed.value
    assert "shape_overrides" not in str(failed.value)


# ------------------------------------------------------------------ through the gateway


def builtin_job(task: str, **fields) -> dict:
    return {"op_name": "relu", "task_desc": task, "backend": "cpu", "coder": "builtin",
            "max_attempts": 1, "trials": 1, **fields}


async def test_timeout_above_the_tenants_cap_is_refused(tmp_path: Path, settings: Settings,
                                                        start_gateway, fake_worker_heartbeat,
                                                        bus: Bus) -> None:
    settings = msgspec.structs.replace(
        settings, tenants_file=tenants_toml(tmp_path, team_a={"max_timeout_s": 120}))
    await fake_worker_heartbeat(bus)
    url = await start_gateway(settings)
    async with httpx.AsyncClient(base_url=url, timeout=scaled(15)) as client:
        r = await client.post("/api/v1/jobs/submit", headers=auth("team_a"),
                              json=builtin_job(RELU_TASK, timeout_s=300))
        assert r.status_code == 403, r.text
        assert r.json()["limit"] == "max_timeout_s"
        assert "timeout_s up to 120 s (max_timeout_s); this one asks for 300 s" in \
            r.json()["detail"]
        # team_b has the default cap (AIKG_TENANT_MAX_TIMEOUT_S, 600 s).
        r = await client.post("/api/v1/jobs/submit", headers=auth("team_b"),
                              json=builtin_job(RELU_TASK, timeout_s=601))
        assert r.status_code == 403 and "up to 600 s" in r.json()["detail"], r.text
        r = await client.post("/api/v1/jobs/submit", headers=auth("team_a"),
                              json=builtin_job(RELU_TASK, timeout_s=120))
        assert r.status_code in (200, 201), r.text
        # Left out, the default (300 s) is lowered to the tenant's cap, not refused.
        body = builtin_job(RELU_TASK)
        body.pop("timeout_s", None)
        r = await client.post("/api/v1/jobs/submit", headers=auth("team_a"), json=body)
        assert r.status_code in (200, 201), r.text
        record = (await client.get(f"/api/v1/jobs/{r.json()['job_id']}",
                                   headers=auth("team_a"))).json()
        assert record["request"]["timeout_s"] == 120
        # Spellings that try to pass an explicit value off as left out are explicit.
        for spelled in ('"timeout\\u005fs": 300', '"timeout_s": 300, "timeout_s": 300'):
            raw = json.dumps(body)[:-1] + ", " + spelled + "}"
            r = await client.post("/api/v1/jobs/submit", headers={
                **auth("team_a"), "Content-Type": "application/json"}, content=raw.encode())
            assert r.status_code == 403 and r.json()["limit"] == "max_timeout_s", (spelled, r.text)


@pytest.mark.slow
async def test_hanging_tasks_of_one_tenant_leave_another_tenants_relu_near_idle(
        shared_services, tmp_path: Path, settings: Settings, start_gateway, bus: Bus) -> None:
    """Four jobs of team_a whose Model hangs (in the generator's lowering child) hold
    at most their share (0.75: three) of the generator's four slots: team_b's relu, measured alone and then
    behind them, stays within 2x its idle time (plus slack for a loaded machine);
    team_a's jobs end naming the task's code."""
    hang_s = 20.0
    settings = msgspec.structs.replace(settings, tenants_file=tenants_toml(tmp_path),
                                       lowering_timeout_s=hang_s)
    url = await start_gateway(settings)
    async with shared_services(settings, bus), \
            httpx.AsyncClient(base_url=url, timeout=scaled(15)) as client:

        async def run_b(task: str) -> tuple[dict, float]:
            started = time.monotonic()
            r = await client.post("/api/v1/jobs/submit", headers=auth("team_b"),
                                  json=builtin_job(task))
            assert r.status_code in (200, 201), r.text
            client.headers["authorization"] = auth("team_b")["Authorization"]
            record = await wait_terminal(client, r.json()["job_id"], timeout_s=120)
            return record, time.monotonic() - started

        record, idle = await run_b(RELU_TASK)
        assert record["status"] == "completed", record
        hung = []
        for i in range(4):
            r = await client.post("/api/v1/jobs/submit", headers=auth("team_a"),
                                  json=builtin_job(HANG_IN_MODEL + f"\n# job {i}\n"))
            assert r.status_code in (200, 201), r.text
            hung.append(r.json()["job_id"])
        # team_a's jobs are running (lowering, hung) before team_b's second relu.
        for _ in range(200):
            states = [(await client.get(f"/api/v1/jobs/{j}", headers=auth("team_a"))
                       ).json()["status"] for j in hung]
            if states.count("running") >= 3:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)  # a fourth would start now, were it allowed to
        states = [(await client.get(f"/api/v1/jobs/{j}", headers=auth("team_a"))
                   ).json()["status"] for j in hung]
        assert states.count("running") == 3, states  # its share: 3 of the 4 job slots
        # Another source, so the built-in coder's cache does not skip the lowering.
        record, loaded = await run_b(RELU_TASK + "\n# behind team_a\n")
        assert record["status"] == "completed", record
        print(f"team_b relu: idle {idle:.2f} s, behind team_a's hanging jobs {loaded:.2f} s")
        assert loaded < 2 * idle + 5.0, (idle, loaded)
        assert loaded < hang_s, (idle, loaded)
        client.headers["authorization"] = auth("team_a")["Authorization"]
        for job_id in hung:
            ended = await wait_terminal(client, job_id, timeout_s=4 * hang_s + 60)
            assert ended["status"] == "failed", ended
            assert f"the task's Model(*get_init_inputs()) did not finish in {hang_s:g} s" \
                in ended["error"], ended["error"]
            assert "infrastructure" not in ended["error"]


@pytest.mark.slow
async def test_a_tenant_at_its_device_share_waits_behind_another_tenants_request(
        settings: Settings, bus: Bus, bus_credentials: BusCredentials) -> None:
    """Two one-device workers of one backend/arch. team_a's first request hangs in its
    reference on worker 1 (half the devices: its share); then team_a and team_b each
    publish one more. Worker 2, started after, takes team_b's, though team_a's lane
    comes first in turn; team_a's hung request ends naming the task."""
    hang_s = 30.0
    base = msgspec.structs.replace(settings, task_timeout_s=hang_s, worker_devices="0")
    stop = asyncio.Event()

    async def publish(req: VerifyRequest) -> None:
        await bus.js.publish(subjects.verify_lane("cpu", "x86_64", req.tenant, "normal"),
                             encode(req), headers={"Nats-Msg-Id": req.request_id})

    workers = [asyncio.create_task(run_worker(msgspec.structs.replace(
        base, **bus_credentials.worker_settings(TEST_WORKER_IDS[0]), worker_arch="x86_64"),
        stop))]
    try:
        async with VerdictWaiter(bus.js, "fair") as waiter:
            for rid in ("a-hang", "a-next", "b-relu"):
                waiter.expect(rid)
            await publish(request(HANG_IN_MODEL, "a-hang", tenant="team_a"))
            for _ in range(600):  # worker 1 leases its device for team_a
                keys = []
                with contextlib.suppress(Exception):
                    keys = await bus.leases.keys()
                if keys:
                    break
                await asyncio.sleep(0.1)
            lease = msgspec.json.decode((await bus.leases.get(keys[0])).value)
            assert (lease["tenant"], lease["backend"], lease["arch"]) == \
                ("team_a", "cpu", "x86_64")
            await publish(request(HANG_IN_MODEL, "a-next", tenant="team_a"))
            await publish(request(RELU_TASK, "b-relu", tenant="team_b"))
            workers.append(asyncio.create_task(run_worker(msgspec.structs.replace(
                base, **bus_credentials.worker_settings(TEST_WORKER_IDS[1]),
                worker_arch="x86_64"), stop)))
            result = await waiter.wait("b-relu", 120)
            assert result.passed, result
            assert result.worker_id == TEST_WORKER_IDS[1]
            # team_b did not wait for a device team_a's hang held.
            assert not waiter.futures["a-hang"].done(), "team_b waited for team_a's hang"
            hung = await waiter.wait("a-hang", 120)
            assert hung.stage == "task" and hung.error.startswith(
                "the task's Model(*get_init_inputs()) did not finish in 30 s"), hung
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*workers, return_exceptions=True), 60)
