"""The fleet's dispatch ceiling: verifications dispatched per second, 1 to 64 workers.

``python -m bench.fleet`` starts one embedded nats-server (a fresh store per point)
and real :class:`services.worker.service.Worker` s whose device is simulated: it
sleeps ``--device-ms`` per verification instead of verifying. Everything else is the
worker's own path: the tenant lanes and their pull asks, the cancelled-job lookup,
the device lease put/renew/delete, the share watches, heartbeats, the result's
JetStream publish and the ack. The driver keeps ``--depth`` requests per worker
outstanding (closed loop: each result is answered by a new request), spread round-robin
over ``--tenants`` tenant lanes and the default lane, and for each fleet size prints:

- ``dispatched/s``: verifications started per second in the measured window;
- ``ideal/s``: ``workers / device time``, what a free bus would allow;
- ``p50`` / ``p99``: dispatch latency, ms, from the request's publish (its
  ``created_at``, stamped just before) to the simulated device starting it;
- ``bus share``: of each worker's time, the part its device was idle,
  ``1 - dispatched/s x device time / workers``;
- what the server handled per verification: client messages in and out
  (``/varz``), JetStream API calls (``/jsz``) and KV writes (stored messages of the
  ``KV_*`` streams), and the CPU milliseconds the worker processes, the server and
  this driver spent (``/proc/<pid>/stat``): on a small machine the sum is the ceiling.

``--baseline REV`` runs every point a second time with the workers' code from
``git archive`` of that revision (the bench itself, and the simulated device, from
this checkout), so both curves come from one run on the same machine load.

    python -m bench.fleet                          # 1 4 16 64 workers, 5 s each
    python -m bench.fleet --workers 1 4 --seconds 2
    python -m bench.fleet --baseline 51a5dbe       # beside the revision before the cuts

Workers run several to a process (``--procs``, default 4): a worker process that
imports the verifier's modules (revisions before the worker imported them only for a
real verifier do, even here) takes about 235 MB resident and 1.9 CPU-seconds to start,
measured on this project's 2-core machine, so 64 processes would take 15 GB and two
minutes of CPU; each worker keeps its own NATS connection, as separate processes would.

The simulated device (:class:`SimulatedDevice`) is reachable only from this bench:
no setting or command of the services builds it (``aikg worker`` always runs the
real verifier); the bench hands it to the workers it starts, on an embedded server of
its own, on the arch :data:`SIM_ARCH`; and it runs only requests whose code is this
bench run's marker with its random token, answering any other request with a failed
``infrastructure`` result that names the refusal. Its results are failed
``infrastructure`` verdicts that say they are simulated, so nothing can count them as
passes. Measured figures, never a gate: exit status 0, or 2 when the fleet does not
come up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import add_number_options
from bench.job_latency import export_revision

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a file by a worker host: the repository root
    sys.path.append(str(ROOT))
# The arch the simulated workers serve: no real worker or request uses it.
SIM_ARCH = "fleet-sim"
BACKEND = "cpu"
JOB_ID = "fleet-bench"
# A bench request's code: this prefix and the run's token; anything else is refused.
MARKER = "# aikg bench.fleet simulated request, run "
DEFAULT_SIZES = (1, 4, 16, 64)
# How long the fleet of one point may take to register, seconds.
READY_TIMEOUT_S = 120.0


class _NoSandbox:
    """What the worker's heartbeat reads of a verifier's sandbox: not started."""

    started = False


class SimulatedDevice:
    """A verifier-shaped device for :class:`~services.worker.service.Worker` that
    sleeps ``device_s`` seconds per request instead of verifying.

    Args:
        worker_id: the worker it is lent to (its results name it).
        device_s: seconds one verification takes.
        token: this bench run's secret; only requests whose ``code`` is
            ``MARKER + token`` on ``SIM_ARCH`` are run.

    Every result is a failed ``infrastructure`` verdict: ``error`` says it was
    simulated (or refused), ``phases["simulated_dispatch"]`` holds the seconds from
    the request's ``created_at`` to the device's start (wall clock, one machine).
    """

    sandbox = _NoSandbox()

    def __init__(self, worker_id: str, device_s: float, token: str) -> None:
        if not token:
            raise ValueError("a simulated device needs the bench run's token")
        self.worker_id = worker_id
        self.device_s = device_s
        self.expected = MARKER + token
        self.shared_cache: Any = None
        self.sandbox_notes = ["simulated device (bench/fleet.py): nothing is verified"]
        self.runs = 0
        self.refused = 0

    def start(self) -> None:
        """Nothing to start (the real verifier starts its fork server here)."""

    def close(self) -> None:
        """Nothing to stop."""

    async def verify(self, request: Any, *, device: str, on_phase: Any = None) -> Any:
        from schemas import VerifyResult, utcnow

        started = utcnow()
        created = request.created_at
        dispatch = max(0.0, (started - created).total_seconds()) if created.tzinfo else 0.0
        common = dict(request_id=request.request_id, job_id=request.job_id,
                      candidate_id=request.candidate_id, worker_id=self.worker_id,
                      device=device, passed=False, stage="infrastructure",
                      interpreted=True)
        if request.code != self.expected or request.arch != SIM_ARCH:
            self.refused += 1
            return VerifyResult(**common, error=(
                "refused by the simulated device of bench/fleet.py: not a request of its "
                "bench run; nothing was verified"), notes=["simulated device: refused"])
        self.runs += 1
        await asyncio.sleep(self.device_s)
        return VerifyResult(
            **common, error=f"simulated device: slept {self.device_s:g} s, nothing verified",
            notes=["simulated device (bench/fleet.py)"], duration_s=self.device_s,
            phases={"simulated_dispatch": round(dispatch, 6)})


# ---------------------------------------------------------------- worker host process

async def host(url: str, ids: list[str], device_s: float, token: str,
               replicas: int = 1) -> None:
    """Run the workers ``ids`` in this process until SIGTERM/SIGINT."""
    from services.common.bus import connect_bus
    from services.common.settings import load_settings
    from services.worker.service import Worker

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    buses, runs = [], []
    for worker_id in ids:
        settings = load_settings(env={}, nats_url=url, worker_backend=BACKEND,
                                 worker_arch=SIM_ARCH, worker_devices="0",
                                 worker_id=worker_id, metrics_port=-1,
                                 baseline_cache_bytes=0, log_format="console",
                                 stream_replicas=replicas)
        bus = await connect_bus(settings, f"aikg-bench-{worker_id}", role="worker")
        buses.append(bus)
        worker = Worker(bus, settings, verifier=SimulatedDevice(worker_id, device_s, token))
        runs.append(asyncio.create_task(worker.run(stop)))
    await stop.wait()
    await asyncio.gather(*runs, return_exceptions=True)
    for bus in buses:
        with contextlib.suppress(Exception):
            await bus.close()


# ---------------------------------------------------------------- the driver

@dataclass
class Point:
    """One fleet size under one code revision."""

    config: str
    workers: int
    started: int = 0
    dispatch: list[float] = field(default_factory=list)
    refused: int = 0
    seconds: float = 0.0
    counts: dict[str, float] = field(default_factory=dict)

    def rate(self) -> float:
        return self.started / self.seconds if self.seconds else 0.0


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc/<pid>/stat``); 0 when
    it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as answer:  # noqa: S310 - loopback
        return json.loads(answer.read())


async def server_counts(servers: list[Any], js: Any,
                        host_pids: list[int]) -> dict[str, float]:
    """What the servers have handled so far (summed over a cluster's nodes): client
    messages in/out, JetStream API calls, messages stored in the ``KV_*`` streams (once,
    not per replica); CPU seconds of the servers, the worker hosts and this driver."""
    msgs_in = msgs_out = api = 0.0
    for server in servers:
        varz = await asyncio.to_thread(_get_json, f"{server.monitor_url}/varz")
        jsz = await asyncio.to_thread(_get_json, f"{server.monitor_url}/jsz")
        msgs_in += float(varz.get("in_msgs", 0))
        msgs_out += float(varz.get("out_msgs", 0))
        api += float((jsz.get("api") or {}).get("total", 0))
    kv = 0
    for name in ("KV_jobs", "KV_workers", "KV_leases"):
        with contextlib.suppress(Exception):
            kv += (await js.stream_info(name)).state.last_seq
    return {"server cpu": sum(cpu_seconds(server.pid or 0) for server in servers),
            "workers cpu": sum(cpu_seconds(pid) for pid in host_pids),
            "driver cpu": cpu_seconds(os.getpid()),
            "msgs in": msgs_in, "msgs out": msgs_out, "js api": api, "kv writes": float(kv)}


async def run_point(config: str, code_root: Path, workers: int, args: argparse.Namespace,
                    workdir: Path) -> Point:
    """Start a server and ``workers`` simulated workers running ``code_root``'s services,
    drive them for ``args.seconds`` and measure.

    Raises:
        RuntimeError: the server or the fleet did not come up.
    """
    import msgspec

    from schemas import VerifyResult, encode, subjects, utcnow
    from services.common.bus import bucket_entries, connect_bus
    from services.common.settings import load_settings
    from services.common.verify_client import build_request

    point = Point(config, workers)
    token = secrets.token_hex(8)
    servers = start_servers(workdir / f"nats-{config}-{workers}", args.cluster)
    url = ",".join(server.url for server in servers)
    replicas = 3 if args.cluster else 1
    procs: list[subprocess.Popen] = []
    try:
        if args.cluster:
            await meta_leader(servers)
        settings = load_settings(env={}, nats_url=url, metrics_port=-1, log_format="console",
                                 stream_replicas=replicas)
        bus = await connect_bus(settings, "aikg-bench-fleet")
        nproc = max(1, min(workers, args.procs))
        ids = [f"sim-{i:03d}" for i in range(workers)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("AIKG_")}
        env["PYTHONPATH"] = str(code_root)
        for p in range(nproc):
            mine = ids[p::nproc]
            procs.append(subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--host", url,
                 "--host-ids", ",".join(mine), "--device-ms", str(args.device_ms),
                 "--token", token, "--replicas", str(replicas)], env=env, cwd=workdir, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=(workdir / f"host-{config}-{workers}-{p}.log").open("wb")))
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            with contextlib.suppress(Exception):
                if len(await bucket_entries(bus.js, subjects.BUCKET_WORKERS)) >= workers:
                    break
            if time.monotonic() > deadline or any(pr.poll() is not None for pr in procs):
                raise RuntimeError(f"{workers} simulated workers ({config}) did not come up; "
                                   f"see {workdir}/host-{config}-{workers}-*.log")
            await asyncio.sleep(0.2)

        lanes = [subjects.verify(BACKEND, SIM_ARCH)] + [
            subjects.verify_lane(BACKEND, SIM_ARCH, f"t{n}", "normal")
            for n in range(args.tenants)]
        tenants = [subjects.DEFAULT_TENANT] + [f"t{n}" for n in range(args.tenants)]
        sent = 0
        window = {"open": False}
        publishes: set[asyncio.Task] = set()

        async def publish_one() -> None:
            nonlocal sent
            i = sent
            sent += 1
            request = build_request(
                request_id=f"r{i}", job_id=JOB_ID, candidate_id=f"c{i}", op_name="fleet",
                task_desc="# simulated\n", code=MARKER + token, backend=BACKEND,
                arch=SIM_ARCH, trials=1, tenant=tenants[i % len(lanes)],
                created_at=utcnow())
            await bus.js.publish(lanes[i % len(lanes)], encode(request),
                                 headers={"Nats-Msg-Id": f"fleet-{token}-{i}"})

        def spawn() -> None:
            task = asyncio.create_task(publish_one())
            publishes.add(task)
            task.add_done_callback(publishes.discard)

        async def on_result(msg) -> None:
            result = msgspec.json.decode(msg.data, type=VerifyResult)
            if window["open"]:
                if result.error and result.error.startswith("refused"):
                    point.refused += 1
                else:
                    point.started += 1
                    point.dispatch.append(result.phases.get("simulated_dispatch", 0.0))
            spawn()

        sub = await bus.nc.subscribe(subjects.job_verdicts(JOB_ID), cb=on_result)
        for _ in range(workers * args.depth):
            spawn()
        await asyncio.sleep(args.warmup)
        before = await server_counts(servers, bus.js, [pr.pid for pr in procs])
        window["open"] = True
        opened = time.monotonic()
        await asyncio.sleep(args.seconds)
        window["open"] = False
        point.seconds = time.monotonic() - opened
        after = await server_counts(servers, bus.js, [pr.pid for pr in procs])
        point.counts = {k: after[k] - before[k] for k in after}
        await sub.unsubscribe()
        await asyncio.gather(*publishes, return_exceptions=True)
        await bus.close()
    finally:
        for pr in procs:
            with contextlib.suppress(ProcessLookupError):
                pr.send_signal(signal.SIGTERM)
        for pr in procs:
            try:
                pr.wait(30)
            except subprocess.TimeoutExpired:
                pr.kill()
                pr.wait()
        for server in servers:
            server.stop()
    return point


def start_servers(root: Path, cluster: bool) -> list[Any]:
    """One embedded nats-server, or three clustered on loopback (``--cluster``).

    Raises:
        RuntimeError: a server did not start.
    """
    from services.common.embedded import EmbeddedNatsServer
    from services.common.runtime import free_port

    if not cluster:
        server = EmbeddedNatsServer(root, die_with_parent=True)
        server.start()
        return [server]
    names = ["n1", "n2", "n3"]
    route_ports = [free_port() for _ in names]
    routes = ",".join(f"nats://127.0.0.1:{p}" for p in route_ports)
    servers = [EmbeddedNatsServer(root / name, port=free_port(), die_with_parent=True,
                                  extra_args=["-n", name, "--cluster_name", "aikg-bench",
                                              "-cluster", f"nats://127.0.0.1:{route}",
                                              "-routes", routes])
               for name, route in zip(names, route_ports, strict=True)]
    try:
        for server in servers:
            server.start()
    except RuntimeError:
        for server in servers:
            server.stop()
        raise
    return servers


async def meta_leader(servers: list[Any], timeout_s: float = 60.0) -> None:
    """Wait until every node of a cluster names the same JetStream meta leader.

    Raises:
        RuntimeError: none within ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        leaders = set()
        for server in servers:
            with contextlib.suppress(Exception):
                jsz = await asyncio.to_thread(_get_json, f"{server.monitor_url}/jsz")
                leaders.add((jsz.get("meta_cluster") or {}).get("leader") or "")
        if len(leaders) == 1 and "" not in leaders:
            return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"the cluster elected no JetStream meta leader within {timeout_s} s")


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank; 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def print_curve(points: list[Point], device_s: float) -> None:
    print(f"\n{'curve':<6}{'config':<10}{'workers':>8}{'dispatched/s':>14}{'ideal/s':>9}"
          f"{'p50 ms':>8}{'p99 ms':>8}{'bus share':>10}{'msgs in':>9}{'msgs out':>9}"
          f"{'js api':>8}{'kv writes':>10}{'cpu ms: workers':>16}{'server':>7}{'driver':>7}"
          "  (per verification)")
    for p in points:
        rate = p.rate()
        ideal = p.workers / device_s
        share = max(0.0, 1.0 - rate * device_s / p.workers)
        per = {k: (v / p.started if p.started else 0.0) for k, v in p.counts.items()}
        print(f"{'curve':<6}{p.config:<10}{p.workers:>8}{rate:>14.1f}{ideal:>9.0f}"
              f"{1000 * percentile(p.dispatch, 0.5):>8.1f}"
              f"{1000 * percentile(p.dispatch, 0.99):>8.1f}{100 * share:>9.0f}%"
              f"{per['msgs in']:>9.1f}{per['msgs out']:>9.1f}{per['js api']:>8.1f}"
              f"{per['kv writes']:>10.1f}{1000 * per['workers cpu']:>16.2f}"
              f"{1000 * per['server cpu']:>7.2f}{1000 * per['driver cpu']:>7.2f}")
        if p.refused:
            print(f"  {p.refused} requests refused by the simulated device (a bench bug)")
    by = {(p.config, p.workers): p for p in points}
    for p in points:
        base = by.get(("baseline", p.workers))
        if p.config == "this" and base is not None and base.rate():
            print(f"ratio this/baseline at {p.workers} workers: {p.rate() / base.rate():.2f}x")


async def bench(args: argparse.Namespace) -> int:
    configs: list[tuple[str, Path]] = [("this", ROOT)]
    with tempfile.TemporaryDirectory(prefix="aikg-fleet-") as tmp:
        workdir = Path(tmp)
        if args.baseline:
            try:
                configs.insert(0, ("baseline", export_revision(args.baseline, workdir)))
            except subprocess.CalledProcessError as exc:
                print(f"git archive {args.baseline}: {exc.stderr.decode().strip()}",
                      file=sys.stderr)
                return 2
        print(f"fleet: device {args.device_ms:g} ms per verification, {args.tenants} tenant "
              f"lanes + the default lane, depth {args.depth} per worker, {args.seconds:g} s "
              f"per point after {args.warmup:g} s warm-up, workers in at most {args.procs} "
              f"processes, {'a 3-node cluster (R3)' if args.cluster else 'one server'}; "
              f"{os.cpu_count()} CPUs, load average "
              f"{os.getloadavg()[0]:.1f}", flush=True)
        points = []
        for workers in args.workers:
            for config, root in configs:
                try:
                    point = await run_point(config, root, workers, args, workdir)
                except RuntimeError as exc:
                    print(exc, file=sys.stderr)
                    for log in sorted(workdir.glob("host-*.log")):
                        sys.stderr.write(log.read_text(errors="replace")[-2000:])
                    return 2
                points.append(point)
                print(f"  {config} {workers} workers: {point.rate():.1f}/s", flush=True)
        print_curve(points, args.device_ms / 1000)
        print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=list(DEFAULT_SIZES),
                        help="fleet sizes, one point each (default 1 4 16 64)")
    add_number_options(parser, (
        ("--seconds", float, 5.0, "measured seconds per point"),
        ("--warmup", float, 1.0, "seconds driven before the measured window"),
        ("--device-ms", float, 50.0, "simulated device time per verification, ms"),
        ("--tenants", int, 3, "tenant lanes besides the default lane"),
        ("--depth", int, 2, "requests kept outstanding per worker"),
        ("--procs", int, 4, "most worker processes; workers are spread over them"),
    ))
    parser.add_argument("--baseline", default=None,
                        help="also run every point with the workers of this git revision")
    parser.add_argument("--cluster", action="store_true",
                        help="a 3-node nats-server cluster on loopback, streams and buckets "
                             "with 3 replicas, instead of one server")
    parser.add_argument("--host", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--replicas", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--host-ids", default="", help=argparse.SUPPRESS)
    parser.add_argument("--token", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    from services.common.logging import configure_logging

    if args.host:
        configure_logging("bench", "warning", "console")
        asyncio.run(host(args.host, args.host_ids.split(","), args.device_ms / 1000,
                         args.token, args.replicas))
        return 0
    if (min(args.workers) < 1 or args.seconds <= 0 or args.warmup < 0
            or args.device_ms <= 0 or args.tenants < 0 or args.depth < 1 or args.procs < 1):
        parser.error("--workers, --depth and --procs must be >= 1, --seconds and "
                     "--device-ms > 0, --warmup and --tenants >= 0")
    configure_logging("bench", "warning", "console")
    return asyncio.run(bench(args))


if __name__ == "__main__":
    sys.exit(main())
