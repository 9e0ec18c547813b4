"""Gateway requests per second: submit and status beside a no-op route of the same server.

``python -m bench.gateway_requests``. Starts an embedded nats-server and one gateway
process (``aikg gateway``) on loopback, puts a fake worker heartbeat in the
``workers`` bucket (so submissions are accepted; no generator runs, so jobs stay
pending), then drives, from this process with ``--concurrency`` requests in flight:

* ``GET /healthz`` — the no-op route: HTTP, routing and the ASGI stack, nothing else;
* ``POST /api/v1/jobs`` — a relu task: validation, static task check, live-worker
  lookup, record create (KV), publish on ``jobs.submit`` and the ``submitted`` event;
* ``GET /api/v1/jobs/{id}/status`` — one KV read and the record's JSON;
* ``GET /api/v1/jobs?limit=50`` — a listing: every record of the bucket read once.

Routes are measured in rounds (healthz, submit, status, list, healthz, ...) so all of
them see the same machine load, each round bounded by ``--requests`` and
``--seconds``. Printed: requests per second, p50 / p99 latency in milliseconds, and
each route's rate as a ratio of the no-op route's. Client and server share the
machine, so absolute numbers say little; the ratios say what a route costs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from bench import add_number_options, stop_process
from services.common.runtime import free_port

ROOT = Path(__file__).resolve().parent.parent
TASK = (ROOT / "tasks" / "relu.py").read_text()


async def drive(client: httpx.AsyncClient, make: Callable[[int], tuple[str, str, dict]],
                count: int, seconds: float, concurrency: int) -> tuple[int, float, list[float]]:
    """Send up to ``count`` requests (stop after ``seconds``), ``concurrency`` at a time.

    Returns:
        (requests answered 2xx, wall seconds, latencies in seconds).
    Raises:
        RuntimeError: a request got a non-2xx answer (the numbers would be wrong).
    """
    latencies: list[float] = []
    next_index = 0
    started = time.perf_counter()
    deadline = started + seconds

    async def one_lane() -> None:
        nonlocal next_index
        while next_index < count and time.perf_counter() < deadline:
            i = next_index
            next_index += 1
            method, url, kwargs = make(i)
            t0 = time.perf_counter()
            r = await client.request(method, url, **kwargs)
            latencies.append(time.perf_counter() - t0)
            if r.status_code >= 300:
                raise RuntimeError(f"{method} {url} -> {r.status_code}: {r.text[:300]}")

    await asyncio.gather(*(one_lane() for _ in range(concurrency)))
    return len(latencies), time.perf_counter() - started, latencies


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run(args: argparse.Namespace) -> int:
    from schemas import WorkerInfo, encode
    from services.common.bus import connect_bus
    from services.common.embedded import EmbeddedNatsServer
    from services.common.logging import configure_logging
    from services.common.settings import load_settings

    configure_logging("bench", "error", "console")

    store = tempfile.TemporaryDirectory(prefix="aikg-bench-nats-")
    nats = EmbeddedNatsServer(store.name)
    nats_url = nats.start()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIKG_")}
    env.update(AIKG_NATS_URL=nats_url, AIKG_LOG_LEVEL="warning", PYTHONUNBUFFERED="1")
    gateway = subprocess.Popen([sys.executable, "-m", "services.cli", "gateway",
                                "--host", "127.0.0.1", "--port", str(port)],
                               cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, start_new_session=True)
    settings = load_settings(env={}, nats_url=nats_url, log_level="warning")
    bus = await connect_bus(settings, "bench")
    info = WorkerInfo(worker_id="bench-fake-worker", backend="cpu", arch="x86_64",
                      devices=["0"], capacity=1)

    async def heartbeat() -> None:
        while True:
            await bus.workers.put(info.worker_id, encode(info))
            await asyncio.sleep(settings.worker_heartbeat_s / 2)

    beat = asyncio.create_task(heartbeat())
    limits = httpx.Limits(max_connections=args.concurrency,
                          max_keepalive_connections=args.concurrency)
    try:
        async with httpx.AsyncClient(base_url=base, timeout=30.0, limits=limits) as client:
            for _ in range(200):
                with contextlib.suppress(httpx.TransportError):
                    if (await client.get("/readyz")).status_code == 200:
                        break
                if gateway.poll() is not None:
                    raise RuntimeError(f"gateway exited: {gateway.stderr.read().decode()[-2000:]}")
                await asyncio.sleep(0.1)
            job_ids: list[str] = []
            body = {"op_name": "relu", "task_desc": TASK, "backend": "cpu", "arch": "x86_64"}
            routes: dict[str, Callable[[int], tuple[str, str, dict]]] = {
                "GET /healthz (no-op)": lambda i: ("GET", "/healthz", {}),
                "POST /api/v1/jobs (submit)": lambda i: ("POST", "/api/v1/jobs", {"json": body}),
                "GET /api/v1/jobs/{id}/status": lambda i: (
                    "GET", f"/api/v1/jobs/{job_ids[i % len(job_ids)]}/status", {}),
                "GET /api/v1/jobs?limit=50 (list)": lambda i: (
                    "GET", "/api/v1/jobs", {"params": {"limit": 50}}),
            }
            # Warm-up: connections, first-call imports, and jobs for the status route.
            for _ in range(20):
                r = await client.post("/api/v1/jobs", json=body)
                r.raise_for_status()
                job_ids.append(r.json()["job_id"])
            await client.get("/api/v1/jobs")

            totals = {name: [0, 0.0, []] for name in routes}
            for _ in range(args.rounds):
                for name, make in routes.items():
                    n, wall, lat = await drive(client, make, args.requests,
                                               args.seconds / args.rounds, args.concurrency)
                    totals[name][0] += n
                    totals[name][1] += wall
                    totals[name][2].extend(lat)
            listed = (await client.get("/api/v1/jobs", params={"limit": 1})).json()["total"]
    finally:
        beat.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beat
        await bus.close()
        stop_process(gateway, 15)
        nats.stop()
        store.cleanup()

    noop_rate = totals["GET /healthz (no-op)"][0] / totals["GET /healthz (no-op)"][1]
    print(f"gateway {base}, {args.concurrency} requests in flight, {args.rounds} rounds, "
          f"{listed} jobs in the bucket at the end; cpu count {os.cpu_count()}")
    print(f"{'route':36} {'requests':>9} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'vs no-op':>9}")
    for name, (n, wall, lat) in totals.items():
        rate = n / wall if wall else float("nan")
        print(f"{name:36} {n:9d} {rate:9.1f} {statistics.median(lat) * 1000:8.2f} "
              f"{_percentile(lat, 0.99) * 1000:8.2f} {rate / noop_rate:9.2f}")
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_number_options(parser, (
        ("--requests", int, 400, "requests per route per round, at most"),
        ("--seconds", float, 20.0, "time per route, all rounds together, at most"),
        ("--rounds", int, 2, "rounds over the routes, interleaved"),
        ("--concurrency", int, 8, "requests in flight"),
    ))
    sys.exit(asyncio.run(run(parser.parse_args())))


if __name__ == "__main__":
    main()
