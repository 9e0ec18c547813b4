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
import structlog

from schemas import JobSubmit, VerifyRequest, VerifyResult, decode, encode, subjects
from services.common.bus import Bus, JobNotFound, JobStore
from services.common.jobs import new_record
from services.common.nats_auth import BusCredentials
from services.common.settings import Settings
from services.common.shares import TenantSlots, share_slots
from services.common.tenants import hash_token, load_tenants
from services.common.verdicts import VerdictWaiter, claim_nonce, random_key
from services.common.verify_client import build_request
from services.generator.coders.lowering_role import lower_in_sandbox
from services.generator.lowering.errors import LoweringError
from services.generator.service import Generator, run_generator
from services.sandbox.limits import ChildLimits, child_limits_from
from services.worker.service import Worker, run_worker
from services.worker.verifier import Verifier
from tests import helpers
from tests.conftest import TEST_WORKER_IDS, LentSandbox, lend_verifier
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
            timeout_s: float = 120.0, code: str = RELU_KERNEL) -> VerifyRequest:
    return build_request(request_id=request_id, job_id=job_id, candidate_id=request_id,
                         op_name="relu", task_desc=task, code=code, backend="cpu",
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
    assert table.get("default").max_device_share == 0.5  # a tenant of the file like any
    # Without a file there are no tenants to share between: whole shares.
    alone = load_tenants(settings)
    assert alone.get("default").max_device_share == alone.get("default").max_generator_share == 1
    assert alone.get("team_b").max_device_share == 1
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
        settings: Settings, bus: Bus, bus_credentials: BusCredentials, tmp_path: Path) -> None:
    """Two one-device workers of one backend/arch, both tenants in the tenants file at
    the default device share (0.5). team_a's first request hangs in its reference on
    worker 1 (half the devices: its share); then team_a and team_b each publish one
    more. Worker 2, started after, takes team_b's, though team_a's lane comes first in
    turn; team_a's hung request ends naming the task."""
    hang_s = 30.0
    base = msgspec.structs.replace(settings, task_timeout_s=hang_s, worker_devices="0",
                                   tenants_file=tenants_toml(tmp_path))
    stop = asyncio.Event()

    key = random_key()

    async def publish(req: VerifyRequest) -> None:
        req.claim_nonce = claim_nonce(key, req.request_id)
        await bus.js.publish(subjects.verify_lane("cpu", "x86_64", req.tenant, "normal"),
                             encode(req), headers={"Nats-Msg-Id": req.request_id})

    workers = [asyncio.create_task(run_worker(msgspec.structs.replace(
        base, **bus_credentials.worker_settings(TEST_WORKER_IDS[0]), worker_arch="x86_64"),
        stop))]
    try:
        async with VerdictWaiter(bus.js, "fair", key) as waiter:
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


# ------------------------------------------------------------------ shares are caps


# A candidate whose forward hangs (sleeps: no CPU used) until its request's timeout.
HANG_IN_FORWARD = RELU_KERNEL.replace(
    "    def forward(self, x):\n",
    "    def forward(self, x):\n        import time\n        time.sleep(600)\n", 1)
assert HANG_IN_FORWARD != RELU_KERNEL


@pytest.mark.parametrize("borrow", [False, True], ids=["cap", "borrowing"])
async def test_borrowing_lends_idle_slots_only_when_on_and_gives_them_back_first(
        borrow: bool) -> None:
    """Off (the default), a tenant alone on a pool holds its share (2 of 4) and no
    more. On, it takes all 4 while nobody else waits; a slot it gives back then goes
    to another tenant waiting below its share before its own next waiter."""
    slots = TenantSlots(4, lambda tenant: 0.5, "lowering", borrow=borrow)
    entered: list[str] = []
    releases: list[asyncio.Event] = []

    async def use(tenant: str, release: asyncio.Event) -> None:
        async with slots.hold(tenant):
            entered.append(tenant)
            await release.wait()

    tasks = []
    for tenant in ("a",) * 5 + ("b",):
        releases.append(asyncio.Event())
        tasks.append(asyncio.create_task(use(tenant, releases[-1])))
        await asyncio.sleep(0.02)
    if not borrow:
        # a's share is a cap: two slots stay free for b, who got in at once.
        assert entered == ["a", "a", "b"] and slots.in_use() == 3, entered
    else:
        assert entered == ["a", "a", "a", "a"] and slots.waiting == {"a": 1, "b": 1}
        releases[0].set()  # one of a's borrowed slots comes back
        await asyncio.sleep(0.05)
        assert entered == ["a", "a", "a", "a", "b"], entered  # b's, not a's fifth
    for release in releases:
        release.set()
    await asyncio.gather(*tasks)
    assert entered.count("a") == 5 and slots.in_use() == 0 and not slots.waiting


class Verdicts:
    """Every VerifyResult published on ``results.>`` while a test runs, by request id,
    with its arrival (monotonic)."""

    def __init__(self) -> None:
        self.got: dict[str, tuple[VerifyResult, float]] = {}

    async def start(self, bus: Bus) -> None:
        async def on_msg(msg) -> None:
            if msg.subject.endswith(".claim"):
                return  # a worker's claim of a request, not a verdict
            result = decode(msg.data, VerifyResult)
            self.got.setdefault(result.request_id, (result, time.monotonic()))

        await bus.nc.subscribe(f"{subjects.RESULTS_PREFIX}.*.*", cb=on_msg)
        await bus.nc.flush()

    async def wait(self, request_id: str, timeout_s: float = 120) -> tuple[VerifyResult, float]:
        async def arrived():
            return self.got.get(request_id)

        return await helpers.poll_until(arrived, timeout_s, f"the verdict of {request_id}",
                                        every_s=0.02)


async def publish_lane(bus: Bus, req: VerifyRequest, tenant: str | None = None) -> None:
    """Publish ``req`` on the VERIFY lane of ``tenant`` (default: its own)."""
    await bus.js.publish(subjects.verify_lane("cpu", "x86_64", tenant or req.tenant, "normal"),
                         encode(req), headers={"Nats-Msg-Id": req.request_id})


@contextlib.asynccontextmanager
async def worker_running(settings: Settings, bus: Bus, verifier, devices: str = "0,1"):
    """A cpu/x86_64 worker with ``devices`` on the test's bus, in this loop (the
    session's verifier lent to it); on exit its runs are given up (children killed,
    messages nak'ed)."""
    settings = msgspec.structs.replace(settings, worker_devices=devices, worker_arch="x86_64")
    worker = Worker(bus, settings, verifier=lend_verifier(verifier, settings.worker_id))
    stop, abandon = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(worker.run(stop, abandon))
    try:
        await helpers.wait_for_heartbeat(bus, [task])
        yield worker
    finally:
        stop.set()
        abandon.set()
        await asyncio.wait_for(task, scaled(60))


async def lease_tenants(bus: Bus) -> list[str]:
    """The tenant of every lease in the ``leases`` bucket, sorted."""
    out = []
    with contextlib.suppress(Exception):  # an empty bucket has no keys
        for key in await bus.leases.keys():
            with contextlib.suppress(Exception):
                out.append(msgspec.json.decode((await bus.leases.get(key)).value)["tenant"])
    return sorted(out)


@pytest.mark.slow  # a worker in this loop, two relu verifications and a hang
@pytest.mark.timeout(240)
async def test_a_device_share_is_a_cap_so_another_tenants_relu_starts_at_once(
        tmp_path: Path, settings: Settings, bus: Bus, shared_verifier) -> None:
    """team_a at max_device_share 0.5 of a 2-device worker, alone on it with 4 requests
    whose candidate hangs (600 s timeout), holds one device, its share, and no more; the
    other stays free, so team_b's relu, measured alone first, takes at most 2x its idle
    time + 5 s behind them. team_a's other requests wait in its lane, none lost."""
    settings = msgspec.structs.replace(
        settings, tenants_file=tenants_toml(tmp_path, team_a={"max_device_share": 0.5}))
    verdicts = Verdicts()
    await verdicts.start(bus)
    async with worker_running(settings, bus, shared_verifier) as worker:
        started = time.monotonic()
        await publish_lane(bus, request(RELU_TASK, "b-idle", tenant="team_b"))
        result, arrived = await verdicts.wait("b-idle")
        assert result.passed, result
        idle = arrived - started

        peak = [0]

        async def sample() -> None:
            while True:
                peak[0] = max(peak[0], worker.loop.held["team_a"])
                await asyncio.sleep(0.01)

        sampler = asyncio.create_task(sample())
        try:
            for i in range(4):
                await publish_lane(bus, request(RELU_TASK, f"a-hang-{i}", tenant="team_a",
                                                code=HANG_IN_FORWARD, timeout_s=600))

            async def a_running():
                return "team_a" in await lease_tenants(bus)

            await helpers.poll_until(a_running, 60, "team_a's first run")
            await asyncio.sleep(scaled(1.5))  # a second one would have started by now
            # Alone on the fleet, team_a gets its share (1 of 2 devices), not more.
            assert await lease_tenants(bus) == ["team_a"], "team_a holds more than its share"
            assert worker.loop.held["team_a"] == 1 and worker.free.qsize() == 1

            started = time.monotonic()
            await publish_lane(bus, request(RELU_TASK, "b-loaded", tenant="team_b",
                                            code=RELU_KERNEL + "\n# behind team_a\n"))
            result, arrived = await verdicts.wait("b-loaded")
            loaded = arrived - started
        finally:
            sampler.cancel()
        print(f"team_b relu: idle {idle:.2f} s, behind team_a's hanging requests "
              f"{loaded:.2f} s")
        assert result.passed, result
        assert loaded <= 2 * idle + 5.0, (idle, loaded)
        assert peak[0] == 1, peak  # never more than its share, before or after team_b's
        assert not [rid for rid in verdicts.got if rid.startswith("a-hang")]
        lane = subjects.verify_lane("cpu", "x86_64", "team_a", "normal")
        info = await bus.js.stream_info(subjects.STREAM_VERIFY, subjects_filter=lane)
        assert (info.state.subjects or {}).get(lane) == 4  # 1 running, 3 waiting


@pytest.mark.slow  # a worker in this loop, a hang
@pytest.mark.timeout(180)
async def test_with_borrowing_on_a_tenant_alone_takes_every_idle_device(
        tmp_path: Path, settings: Settings, bus: Bus, shared_verifier) -> None:
    """With AIKG_SHARE_BORROW_IDLE on, team_a (share 0.5) alone on a 2-device worker
    takes both devices; team_b's request then waits for one of them to come back: the
    trade-off the setting makes (docs/tenants.md)."""
    settings = msgspec.structs.replace(
        settings, tenants_file=tenants_toml(tmp_path, team_a={"max_device_share": 0.5}),
        share_borrow_idle=True)
    verdicts = Verdicts()
    await verdicts.start(bus)
    async with worker_running(settings, bus, shared_verifier) as worker:
        for i in range(4):
            await publish_lane(bus, request(RELU_TASK, f"a-hang-{i}", tenant="team_a",
                                            code=HANG_IN_FORWARD, timeout_s=600))

        async def both_held():
            return await lease_tenants(bus) == ["team_a", "team_a"]

        await helpers.poll_until(both_held, 60, "team_a on both devices")
        await publish_lane(bus, request(RELU_TASK, "b-late", tenant="team_b"))
        await asyncio.sleep(scaled(1.5))
        assert worker.loop.held["team_a"] == 2 and worker.loop.held["team_b"] == 0
        assert "b-late" not in verdicts.got


# ------------------------------------------------------------------ one tenants file


async def test_a_generator_or_worker_without_a_tenants_file_warns_once_at_start(
        tmp_path: Path, settings: Settings, bus: Bus) -> None:
    for build in (lambda s: Worker(bus, s), lambda s: Generator(bus, s)):
        with structlog.testing.capture_logs() as logs:
            build(settings)
        warned = [e for e in logs if e["event"] == "tenants_file_unset"]
        assert len(warned) == 1, logs
        assert warned[0]["log_level"] == "warning" and warned[0]["setting"] == \
            "AIKG_TENANTS_FILE"
        assert "no tenants to share between" in warned[0]["consequence"]
        with structlog.testing.capture_logs() as logs:
            build(msgspec.structs.replace(settings, tenants_file=tenants_toml(tmp_path)))
        assert not [e for e in logs if e["event"] == "tenants_file_unset"], logs


@pytest.mark.slow  # a worker in this loop (~10 s to start and stop)
async def test_a_worker_fails_a_request_of_a_tenant_not_in_the_tenants_file(
        tmp_path: Path, settings: Settings, bus: Bus, shared_verifier) -> None:
    """With a tenants file, a request of a tenant it does not name (on that tenant's
    lane, or a listed tenant's lane with the unknown tenant in the body) gets a failed
    verdict at stage ``infrastructure`` naming the tenant and the file, unrun, and is
    acked."""
    path = tenants_toml(tmp_path)
    settings = msgspec.structs.replace(settings, tenants_file=path)
    verdicts = Verdicts()
    await verdicts.start(bus)
    async with worker_running(settings, bus, shared_verifier, devices="0"):
        await publish_lane(bus, request(RELU_TASK, "x-own-lane", tenant="team_x"))
        await publish_lane(bus, request(RELU_TASK, "x-in-a-lane", tenant="team_x"),
                           tenant="team_a")
        for rid in ("x-own-lane", "x-in-a-lane"):
            result, _ = await verdicts.wait(rid, 60)
            assert not result.passed and result.stage == "infrastructure", result
            assert result.error.startswith(f"tenant 'team_x' is not in the tenants file {path} "
                                           "(AIKG_TENANTS_FILE)"), result.error
            assert not result.phases.get("trial"), result.phases
    info = await bus.js.stream_info(subjects.STREAM_VERIFY)
    assert info.state.messages == 0  # both acked: nothing left to redeliver


async def test_a_generator_fails_a_job_of_a_tenant_not_in_the_tenants_file(
        tmp_path: Path, settings: Settings, bus: Bus, lowering_sandbox) -> None:
    """With a tenants file, a job on the lane of a tenant it does not name fails at
    once, naming the tenant and the file: published raw (no record yet) or with a
    record (as a gateway with another tenants file would write it). Both messages are
    acked."""
    path = tenants_toml(tmp_path)
    settings = msgspec.structs.replace(settings, tenants_file=path)
    jobs = JobStore(bus.jobs)
    with_record = JobSubmit(op_name="relu", task_desc=RELU_TASK, backend="cpu",
                            job_id="x-recorded")
    await jobs.create(new_record(with_record, arch="x86_64", tenant="team_x"))
    stop = asyncio.Event()
    task = asyncio.create_task(run_generator(settings, stop, sandbox=LentSandbox(lowering_sandbox)))
    try:
        for submit in (JobSubmit(op_name="relu", task_desc=RELU_TASK, backend="cpu",
                                 job_id="x-raw"), with_record):
            await bus.js.publish(subjects.job_submit("team_x", "normal"), encode(submit),
                                 headers={"Nats-Msg-Id": submit.job_id})

        async def failed():
            out = []
            for job_id in ("x-raw", "x-recorded"):
                with contextlib.suppress(JobNotFound):
                    record, _ = await jobs.get(job_id)
                    if record.status == "failed":
                        out.append(record)
            if task.done():
                task.result()
            return out if len(out) == 2 else None

        for record in await helpers.poll_until(failed, 60, "both team_x jobs failed"):
            assert record.error.startswith(f"tenant 'team_x' is not in the tenants file {path} "
                                           "(AIKG_TENANTS_FILE)"), record.error
            assert record.start_time is None  # never started
        info = await bus.js.stream_info(subjects.STREAM_JOBS)
        for _ in range(50):  # the ack follows the record's end
            if info.state.messages == 0:
                break
            await asyncio.sleep(0.1)
            info = await bus.js.stream_info(subjects.STREAM_JOBS)
        assert info.state.messages == 0
    finally:
        stop.set()
        await asyncio.wait_for(task, scaled(60))
