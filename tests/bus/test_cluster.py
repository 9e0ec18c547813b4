"""A 3-node JetStream cluster loses no job when a node is killed and restarted.

Three nats-server processes cluster on loopback (``-cluster``/``-routes``, distinct
store dirs); every stream and bucket is R3 (``stream_replicas=3``). The real gateway,
generator and a 2-slot cpu worker run in this event loop and take 50 relu jobs over
HTTP, paced so that jobs are in flight when the node that leads the most streams and
buckets is killed with SIGKILL, and again when it restarts on the same store dir.

Each job carries a correct relu kernel as ``init_code``, so the generator sends it to
the worker straight away (no lowering): the test measures the bus, not the coder.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from schemas import JobEvent, VerifyResult, decode, subjects
from services.common.bus import Bus, connect_bus
from services.common.embedded import EmbeddedNatsServer
from services.common.nats_auth import BusCredentials
from services.common.settings import Settings, load_settings
from services.generator.service import run_generator
from services.worker.service import run_worker
from tests.conftest import free_port, running_gateway
from tests.helpers import RELU_KERNEL, RELU_TASK, scaled, wait_for_heartbeat

pytestmark = pytest.mark.slow

JOBS = 50
KILL_AFTER = 15  # jobs submitted before the kill
RESTART_AFTER = 30  # jobs submitted before the restart
SUBMIT_GAP_S = 0.25  # pacing, so that jobs keep arriving across the kill and restart



class Cluster:
    """Three clustered nats-servers on loopback with fixed ports, so a restarted node
    comes back where clients and routes expect it."""

    def __init__(self, root: Path, credentials: BusCredentials, size: int = 3) -> None:
        self.names = [f"n{i + 1}" for i in range(size)]
        # Every node takes the users and permissions `aikg up` uses.
        conf = credentials.write_server_config(root / "auth.conf")
        route_ports = [free_port() for _ in self.names]
        routes = ",".join(f"nats://127.0.0.1:{p}" for p in route_ports)
        self.nodes = {
            name: EmbeddedNatsServer(
                root / name, port=free_port(), config_file=conf, die_with_parent=True,
                extra_args=["-n", name, "--cluster_name", "aikg",
                            "-cluster", f"nats://127.0.0.1:{route}", "-routes", routes])
            for name, route in zip(self.names, route_ports, strict=True)
        }

    @property
    def url(self) -> str:
        return ",".join(node.url for node in self.nodes.values())

    def start(self) -> None:
        for node in self.nodes.values():
            node.start()

    def stop(self) -> None:
        for node in self.nodes.values():
            node.stop()

    async def meta_leader(self, timeout_s: float = 30.0) -> str:
        """Name of the JetStream meta leader, once every live node agrees on one."""
        deadline = time.monotonic() + scaled(timeout_s)
        async with httpx.AsyncClient(timeout=scaled(2.0)) as client:
            while time.monotonic() < deadline:
                leaders = set()
                for node in self.nodes.values():
                    if node.proc is None or node.proc.poll() is not None:
                        continue
                    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                        jsz = (await client.get(f"{node.monitor_url}/jsz")).json()
                        leaders.add(jsz.get("meta_cluster", {}).get("leader") or "")
                if len(leaders) == 1 and "" not in leaders:
                    return leaders.pop()
                await asyncio.sleep(0.2)
        raise TimeoutError(f"no JetStream meta leader within {timeout_s} s")


@pytest.fixture
def cluster(tmp_path: Path, bus_credentials: BusCredentials) -> Iterator[Cluster]:
    c = Cluster(tmp_path / "nats", bus_credentials)
    c.start()
    try:
        yield c
    finally:
        c.stop()


@contextlib.asynccontextmanager
async def services(settings: Settings, bus: Bus) -> AsyncIterator[tuple[str, Callable[[], None]]]:
    """Gateway, generator and a cpu worker until the block ends; yields the gateway URL
    and a function that raises when the worker or generator has stopped."""
    from services.common.provision import Provisioner

    stop = asyncio.Event()
    # What `aikg nats-setup --serve` does: makes the consumers the services may only bind.
    provisioner = Provisioner(bus.nc, bus.js, settings)
    await provisioner.start()
    tasks = [asyncio.create_task(run_worker(settings, stop), name="worker"),
             asyncio.create_task(run_generator(settings, stop), name="generator")]
    try:
        async with running_gateway(settings) as url:
            await wait_for_heartbeat(bus, tasks)

            def check() -> None:
                for t in tasks:
                    if t.done():
                        raise AssertionError(f"{t.get_name()} stopped during the test") \
                            from t.exception()

            yield url, check
            check()
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
        await provisioner.stop()


async def submit(client: httpx.AsyncClient, job_id: str, retries: collections.Counter) -> None:
    """Submit one job, retrying what a client retries while a node fails over: a
    transport error, 5xx (a NATS request timed out during the leader election) and
    409 (the worker's heartbeat expired while its bucket changed leader). The same
    ``job_id`` makes a retry idempotent."""
    body = {"op_name": "relu", "task_desc": RELU_TASK, "backend": "cpu", "job_id": job_id,
            "init_code": RELU_KERNEL, "trials": 1, "shape_overrides": {"batch_size": 2, "dim": 64}}
    deadline = time.monotonic() + scaled(60)
    while True:
        try:
            resp = await client.post("/api/v1/jobs/submit", json=body)
            if resp.status_code == 200:
                return
            reason = str(resp.status_code)
            if resp.status_code not in (409, 500, 503):
                raise AssertionError(f"{job_id}: {resp.status_code} {resp.text}")
        except httpx.TransportError as exc:
            reason = type(exc).__name__
        retries[reason] += 1
        if time.monotonic() > deadline:
            raise TimeoutError(f"{job_id} not accepted within 60 s (last: {reason})")
        await asyncio.sleep(0.5)


async def leaders(bus: Bus) -> dict[str, str]:
    """Leader node of every stream (KV buckets are streams ``KV_<bucket>``)."""
    out = {}
    for name in (subjects.STREAM_JOBS, subjects.STREAM_VERIFY, subjects.STREAM_RESULTS,
                 subjects.STREAM_JOB_EVENTS, "KV_jobs", "KV_workers", "KV_leases"):
        info = await bus.js.stream_info(name)
        out[name] = info.cluster.leader if info.cluster else ""
    return out


async def read_all(bus: Bus, subject: str) -> list[bytes]:
    """Every message on ``subject`` (wildcards allowed) from the start of its stream."""
    sub = await bus.js.subscribe(subject, ordered_consumer=True)
    out = []
    try:
        while True:
            msg = await sub.next_msg(timeout=scaled(2.0))
            out.append(msg.data)
    except Exception:  # noqa: BLE001 - timeout: the history is read
        pass
    finally:
        await sub.unsubscribe()
    return out


def await_chain(task: asyncio.Task) -> str:
    """``file:function:line`` of each coroutine ``task`` is suspended in, outermost first."""
    parts = []
    coro: Any = task.get_coro()
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            parts.append(type(coro).__name__)
            break
        parts.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}:"
                     f"{frame.f_lineno}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return " -> ".join(parts)


async def explain(bus: Bus, job_ids: list[str]) -> str:
    """What the bus holds about ``job_ids``: record, events, verify requests, verdicts
    and the consumers' state, so that a lost job's failure says where it stopped."""
    lines = []
    for job_id in job_ids:
        with contextlib.suppress(Exception):
            lines.append(f"record {job_id}: {(await bus.jobs.get(job_id)).value.decode()[:3000]}")
        for subject in (f"{subjects.JOB_EVENTS_PREFIX}.{job_id}", subjects.job_results(job_id)):
            for data in await read_all(bus, subject):
                lines.append(f"{subject}: {data[:400]!r}")
    for stream in (subjects.STREAM_JOBS, subjects.STREAM_VERIFY):
        with contextlib.suppress(Exception):
            for info in await bus.js.consumers_info(stream):
                lines.append(f"consumer {stream}/{info.name}: delivered={info.delivered} "
                             f"ack_floor={info.ack_floor} pending={info.num_pending} "
                             f"ack_pending={info.num_ack_pending} "
                             f"redelivered={info.num_redelivered}")
    for name in (subjects.STREAM_JOBS, subjects.STREAM_VERIFY, subjects.STREAM_RESULTS):
        with contextlib.suppress(Exception):
            info = await bus.js.stream_info(name)
            lines.append(f"stream {name}: {info.state} leader={info.cluster and info.cluster.leader}")
    # Where each of this loop's tasks waits (a stuck job's coroutine shows its await).
    for task in asyncio.all_tasks():
        lines.append(f"task {task.get_name()}: {await_chain(task)}")
    return "\n".join(lines)


async def wait_replicas_current(bus: Bus, timeout_s: float = 60.0) -> None:
    """Wait until every R3 stream has a leader and two current, online followers."""
    deadline = time.monotonic() + scaled(timeout_s)
    lagging: list[str] = []
    while time.monotonic() < deadline:
        lagging = []
        for name in (subjects.STREAM_JOBS, subjects.STREAM_VERIFY, subjects.STREAM_RESULTS,
                     subjects.STREAM_JOB_EVENTS, "KV_jobs"):
            with contextlib.suppress(Exception):
                info = await bus.js.stream_info(name)
                peers = info.cluster.replicas or [] if info.cluster else []
                if (info.cluster and info.cluster.leader and len(peers) == 2
                        and all(p.current and not p.offline for p in peers)):
                    continue
            lagging.append(name)
        if not lagging:
            return
        await asyncio.sleep(0.5)
    raise AssertionError(f"streams without 3 current replicas after the restart: {lagging}")


@pytest.mark.timeout(420)
async def test_fifty_jobs_survive_a_node_kill_and_restart(
        cluster: Cluster, bus_credentials: BusCredentials) -> None:
    started = time.monotonic()
    await cluster.meta_leader()
    port = free_port()
    settings = load_settings(
        env={}, nats_url=cluster.url, stream_replicas=3, worker_heartbeat_s=2.0,
        worker_devices="0,1", gateway_port=port, gateway_url=f"http://127.0.0.1:{port}",
        metrics_port=-1, log_format="console", log_level="warning",
        **bus_credentials.role_settings())
    # The cluster is credentialed: a client without credentials is refused by each node.
    for node in cluster.nodes.values():
        with pytest.raises(ConnectionError, match="refused this client's credentials"):
            await connect_bus(load_settings(env={}, nats_url=node.url), "anonymous")
    bus = await connect_bus(settings, "test-cluster")
    retries: collections.Counter[str] = collections.Counter()
    job_ids = [f"cluster-{i:02d}" for i in range(JOBS)]
    try:
        for name in (subjects.STREAM_JOBS, subjects.STREAM_VERIFY, "KV_jobs", "KV_workers"):
            assert (await bus.js.stream_info(name)).config.num_replicas == 3, name
        async with services(settings, bus) as (url, check):
            up = time.monotonic()
            async with httpx.AsyncClient(base_url=url, timeout=scaled(15)) as client:
                submits = []
                victim = ""
                for i, job_id in enumerate(job_ids):
                    if i == KILL_AFTER:
                        meta = await cluster.meta_leader()
                        led = collections.Counter((await leaders(bus)).values())
                        # The node leading the most streams/buckets; the meta leader on a tie.
                        victim = max(cluster.names, key=lambda n: (led[n], n == meta))
                        cluster.nodes[victim].kill()
                        killed_at = time.monotonic()
                        print(f"killed {victim} (meta leader {meta}, leads {led[victim]} of "
                              f"{sum(led.values())} streams) after {i} submissions")
                    if i == RESTART_AFTER:
                        cluster.nodes[victim].start()
                        print(f"restarted {victim} after {time.monotonic() - killed_at:.1f} s")
                    submits.append(asyncio.create_task(submit(client, job_id, retries)))
                    await asyncio.sleep(SUBMIT_GAP_S)
                    check()
                await asyncio.gather(*submits)

                statuses: dict[str, str] = {}
                deadline = time.monotonic() + scaled(180)
                while len(statuses) < JOBS and time.monotonic() < deadline:
                    check()
                    for job_id in job_ids:
                        if job_id in statuses:
                            continue
                        with contextlib.suppress(Exception):
                            record = json.loads((await bus.jobs.get(job_id)).value)
                            if record["status"] in ("completed", "failed", "cancelled"):
                                statuses[job_id] = f"{record['status']} {record.get('error') or ''}"
                    await asyncio.sleep(0.5)
                missing = sorted(set(job_ids) - set(statuses))
                # Explained while the services still run, so that their tasks' stacks show.
                explained = await explain(bus, missing) if missing else ""
            done = time.monotonic()

        assert not missing, f"jobs never finished (lost): {missing}\n{explained}"
        failed = {j: s for j, s in statuses.items() if not s.startswith("completed")}
        assert not failed, f"jobs that did not complete: {failed}"

        await wait_replicas_current(bus)

        events = [decode(d, JobEvent) for d in await read_all(bus, f"{subjects.JOB_EVENTS_PREFIX}.>")]
        completed = collections.Counter(e.job_id for e in events if e.event == "completed")
        assert {j: completed[j] for j in job_ids if completed[j] != 1} == {}, \
            "each job must have exactly one 'completed' event"

        results = [decode(d, VerifyResult) for d in await read_all(bus, f"{subjects.RESULTS_PREFIX}.*.*")]
        per_request = collections.Counter(r.request_id for r in results)
        assert {r: n for r, n in per_request.items() if n > 1} == {}, "a verdict was published twice"
        passed_jobs = {r.job_id for r in results if r.passed}
        assert passed_jobs >= set(job_ids)

        dlq = await bus.js.stream_info(subjects.STREAM_DLQ)
        assert dlq.state.messages == 0, "nothing may be dead-lettered"
        print(f"cluster test: {JOBS} jobs in {done - up:.1f} s (services up after "
              f"{up - started:.1f} s), {len(results)} verdicts, submit retries {dict(retries)}")
    finally:
        await bus.close()
