"""Time-to-start of one job of tenant B behind a burst of tenant A, FIFO vs fair lanes.

Runs a whole stack in this process (an embedded nats-server, the gateway, one
generator, one cpu worker) twice:

- ``fifo``: no tenants file, so A's burst and B's job share the one lane
  ``jobs.submit`` (and ``verify.cpu.<arch>``): what every deployment had before tenants.
- ``fair``: A and B are tenants with their own tokens, so each waits in its own lane
  and the generator and worker take the lanes in turn (services/common/lanes.py).

A submits ``--jobs`` small relu jobs (``init_code`` given: one candidate each, really
verified by the worker), then B submits one. B's time to start is its record's
``start_time - submit_time``; a job's run time is ``end_time - start_time`` (median
over the finished jobs), and the jobs of A that started while B waited. The fair run
stops once B has finished; the fifo run once B has started. Prints both side by side.

    python -m bench.fairness                 # 100 jobs, generator concurrency 2, 2 slots
    python -m bench.fairness --jobs 30 --concurrency 1 --devices 1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import logging
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from services.common.embedded import EmbeddedNatsServer
from services.common.logging import configure_logging
from services.common.settings import load_settings
from services.common.tenants import hash_token
from services.gateway.app import serve_gateway
from services.generator.service import run_generator
from services.worker.service import run_worker
from tests.helpers import RELU_KERNEL, RELU_TASK


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _t(value: str | None) -> dt.datetime | None:
    return dt.datetime.fromisoformat(value) if value else None


async def run_case(fair: bool, jobs: int, concurrency: int, devices: int, root: Path) -> dict:
    """One stack, one burst; returns B's wait and the jobs' run times, seconds."""
    server = EmbeddedNatsServer(root / ("fair" if fair else "fifo"))
    server.start()
    port = _free_port()
    tokens = {"team_a": "bench-a", "team_b": "bench-b"}
    extra: dict = {}
    if fair:
        path = root / "tenants.toml"
        path.write_text("".join(f'[tenants.{t}]\ntoken_sha256 = "{hash_token(k)}"\n'
                                for t, k in tokens.items()))
        extra["tenants_file"] = str(path)
    settings = load_settings(env={}, nats_url=server.url, gateway_port=port,
                             gateway_url=f"http://127.0.0.1:{port}", metrics_port=-1,
                             worker_devices=",".join(str(i) for i in range(devices)),
                             generator_concurrency=concurrency, log_level="warning",
                             worker_heartbeat_s=1.0, **extra)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(run_worker(settings, stop)),
             asyncio.create_task(run_generator(settings, stop)),
             asyncio.create_task(serve_gateway(settings, stop))]

    def headers(tenant: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {tokens[tenant]}"} if fair else {}

    def body(job_id: str) -> dict:
        return {"op_name": "relu", "task_desc": RELU_TASK, "init_code": RELU_KERNEL,
                "backend": "cpu", "job_id": job_id, "max_attempts": 1, "trials": 1}

    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            for _ in range(1200):  # the worker's first heartbeat (its sandbox starts)
                for t in tasks:
                    if t.done():
                        t.result()
                with contextlib.suppress(httpx.HTTPError):
                    if (await c.get("/api/v1/workers", headers=headers("team_a"))).json()[
                            "workers"]:
                        break
                await asyncio.sleep(0.1)
            for i in range(jobs):
                r = await c.post("/api/v1/jobs/submit", headers=headers("team_a"),
                                 json=body(f"a-{i:03d}"))
                r.raise_for_status()
            r = await c.post("/api/v1/jobs/submit", headers=headers("team_b"), json=body("b-000"))
            r.raise_for_status()
            started = time.monotonic()
            while time.monotonic() - started < 1800:
                b = (await c.get("/api/v1/jobs/b-000", headers=headers("team_b"))).json()
                if (b["end_time"] if fair else b["start_time"]) is not None:
                    break
                await asyncio.sleep(0.2)
            listing = (await c.get("/api/v1/jobs", headers=headers("team_a"),
                                   params={"limit": 500})).json()["jobs"]
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        server.stop()
    runs = [(_t(j["end_time"]) - _t(j["start_time"])).total_seconds()
            for j in listing if j["end_time"] and j["start_time"]]
    # A's jobs that started while B waited (A keeps submitting for a while, and its
    # first jobs start before B is even submitted).
    overtook = sum(1 for j in listing if j["job_id"].startswith("a-") and j["start_time"]
                   and _t(b["submit_time"]) <= _t(j["start_time"]) < _t(b["start_time"]))
    return {"wait_s": (_t(b["start_time"]) - _t(b["submit_time"])).total_seconds(),
            "run_p50_s": statistics.median(runs) if runs else float("nan"),
            "a_started_while_b_waited": overtook}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=100, help="tenant A's burst")
    parser.add_argument("--concurrency", type=int, default=2, help="generator jobs at once")
    parser.add_argument("--devices", type=int, default=2, help="worker slots")
    args = parser.parse_args()
    configure_logging("bench", "warning", "console")
    logging.getLogger().setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="aikg-fairness-") as tmp:
        out = {name: asyncio.run(run_case(name == "fair", args.jobs, args.concurrency,
                                          args.devices, Path(tmp)))
               for name in ("fifo", "fair")}
    print(f"tenant B's single job behind {args.jobs} jobs of tenant A "
          f"(generator concurrency {args.concurrency}, {args.devices} worker slots)")
    print(f"{'':34}{'fifo (one lane)':>18}{'fair (lanes)':>16}")
    for key, label in (("wait_s", "B's time to start, s"),
                       ("a_started_while_b_waited", "A's jobs started while B waited"),
                       ("run_p50_s", "job run time p50, s")):
        f, g = out["fifo"][key], out["fair"][key]
        fmt = "{:>18.2f}{:>16.2f}" if isinstance(f, float) else "{:>18}{:>16}"
        print(f"{label:34}" + fmt.format(f, g))


if __name__ == "__main__":
    main()
