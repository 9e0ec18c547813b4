"""Evolve jobs through the services: HTTP in, islands and migrations in the job
record, with the built-in coder and with a scripted LLM; a generator killed during
round 2 loses none of the candidates verified before."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec
import pytest

from schemas import JobRecord, JobSubmit, decode, encode, subjects
from services.common.bus import Bus, JobNotFound, JobStore
from services.common.settings import Settings
from services.worker.service import run_worker
from tests import helpers
from tests.conftest import role_env
from tests.fake_llm import FakeLLM, Recorded, Reply, fenced
from tests.helpers import BUNDLED_RELU_TASK, RELU_KERNEL, scaled, wait_terminal

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RELU = BUNDLED_RELU_TASK
EVOLVE = {"job_type": "evolve", "max_rounds": 3, "parallel_num": 4, "num_islands": 2,
          "migration_interval": 1, "elite_size": 4, "parent_selection_prob": 0.5,
          "shape_overrides": {"batch_size": 4, "dim": 512}, "trials": 1}

# The scripted LLM's reply: the shared relu kernel with a BLOCK placeholder.
LLM_RELU = RELU_KERNEL.replace("cdiv(n, 1024)", "cdiv(n, BLOCK)").replace("=1024", "=BLOCK")


def check_summary(record: dict, candidates: int) -> None:
    evolve = record["evolve"]
    assert len(evolve["candidates"]) == candidates
    assert [len(i) for i in evolve["islands"]] and all(evolve["islands"])
    assert evolve["migrations"], "two islands, migration_interval=1: must migrate"
    assert any(p["migrant"] for p in evolve["parent_choices"]), \
        "a migration must have changed a parent choice"
    # cpu backend: timings mean nothing; the modeled time of the counted traffic ranks
    assert evolve["fitness"] == "modeled_time"
    passed = [c for c in evolve["candidates"] if c["passed"]]
    assert passed and all(c["modeled_time_us"] > 0 for c in passed), passed
    best = record["result"]["best"]
    assert best and best[0]["code"] and "class ModelNew" in best[0]["code"]
    for entry in best:
        assert entry["passed"] is True
        assert entry["round"] in range(3) and entry["island"] in (0, 1)
    assert any(entry["parent_id"] for c in [evolve["candidates"]] for entry in c)


async def test_evolve_job_over_http_with_the_builtin_coder(
        shared_services, settings: Settings, bus: Bus, gateway: str) -> None:
    settings = msgspec.structs.replace(settings, worker_devices="0,1")
    async with shared_services(settings, bus), httpx.AsyncClient(base_url=gateway,
                                                                  timeout=scaled(10)) as client:
        resp = await client.post("/api/v1/jobs/submit", json={
            "op_name": "relu", "task_desc": RELU, "backend": "cpu", **EVOLVE})
        assert resp.status_code == 200, resp.text
        record = await wait_terminal(client, resp.json()["job_id"], timeout_s=300)
    assert record["status"] == "completed", record["error"]
    assert record["request"]["num_islands"] == 2 and record["request"]["max_rounds"] == 3
    check_summary(record, 12)
    params = {tuple(sorted(c["params"].items())) for c in record["evolve"]["candidates"]}
    assert len(params) == 12, "the launch-parameter search must not repeat a point"


async def test_evolve_job_with_a_scripted_llm(shared_services, settings: Settings, bus: Bus,
                                             gateway: str) -> None:
    def script(index: int, request: Recorded) -> Reply:
        block = [64, 128, 256, 512, 1024, 2048][index % 6]
        return Reply(content=fenced(LLM_RELU.replace("BLOCK)", f"{block})")
                                    .replace("=BLOCK", f"={block}")
                                    + f"\n# variant {index}\n"))

    with FakeLLM(script) as fake:
        llm = msgspec.structs.replace(settings, worker_devices="0,1", llm_base_url=fake.url,
                                      llm_model="fake-coder")
        async with shared_services(llm, bus), httpx.AsyncClient(base_url=gateway,
                                                                 timeout=scaled(10)) as client:
            resp = await client.post("/api/v1/jobs/submit", json={
                "op_name": "relu", "task_desc": RELU, "backend": "cpu", "coder": "llm",
                **EVOLVE})
            assert resp.status_code == 200, resp.text
            record = await wait_terminal(client, resp.json()["job_id"], timeout_s=300)
        prompts = [r.prompt for r in fake.chat_requests()]
    assert record["status"] == "completed", record["error"]
    check_summary(record, 12)
    coders = {c["coder"] for c in record["evolve"]["candidates"]}
    assert "llm" in coders
    mutations = [p for p in prompts if "## Parent" in p]
    assert mutations, "children must be written from a named parent"
    assert any("## Inspiration" in p for p in mutations)
    assert record["progress"]["llm_usage"]["requests"] >= len(prompts)


async def test_generator_killed_in_round_2_keeps_every_verified_candidate(
        settings: Settings, bus: Bus, tmp_path: Path) -> None:
    job_id = "evolve-kill9"
    env = {**os.environ, **role_env(settings, "generator"), "AIKG_METRICS_PORT": "-1",
           "AIKG_LOG_FORMAT": "json", "PYTHONUNBUFFERED": "1"}
    env.pop("AIKG_LLM_BASE_URL", None)
    procs: list[subprocess.Popen[bytes]] = []

    def start_generator() -> subprocess.Popen[bytes]:
        log = (tmp_path / f"generator-{len(procs)}.log").open("wb")
        try:
            proc = subprocess.Popen([sys.executable, "-m", "services.cli", "generator"],
                                    env=env, cwd=ROOT, stdout=log, stderr=log,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()
        procs.append(proc)
        return proc

    def logs() -> str:
        return "\n".join(p.read_text()[-2000:] for p in sorted(tmp_path.glob("generator-*.log")))

    async def record() -> JobRecord | None:
        with contextlib.suppress(JobNotFound):
            return (await JobStore(bus.jobs).get(job_id))[0]
        return None

    stop = asyncio.Event()
    worker_settings = msgspec.structs.replace(settings, worker_devices="0,1")
    worker = asyncio.create_task(run_worker(worker_settings, stop))
    try:
        await helpers.wait_for_heartbeat(bus, [worker])
        submit = JobSubmit(op_name="relu", task_desc=RELU, job_id=job_id,
                           **{k: v for k, v in EVOLVE.items()})
        first = start_generator()
        await bus.js.publish(subjects.JOBS_SUBMIT, encode(submit),
                             headers={"Nats-Msg-Id": job_id})
        deadline = time.monotonic() + scaled(180)
        while True:
            r = await record()
            if r and r.evolve and any(c.round >= 1 and c.passed is not None
                                      for c in r.evolve.candidates):
                break
            assert time.monotonic() < deadline, f"round 2 never started\n{logs()}"
            await asyncio.sleep(0.05)
        before = {c.candidate_id: c.passed for c in r.evolve.candidates if c.passed is not None}
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(10)
        start_generator()
        deadline = time.monotonic() + scaled(240)
        while True:
            r = await record()
            if r and r.status in ("completed", "failed", "cancelled"):
                break
            assert time.monotonic() < deadline, f"resumed job never ended\n{logs()}"
            await asyncio.sleep(0.2)
        assert r.status == "completed", f"{r.error}\n{logs()}"
        after = {c.candidate_id: c.passed for c in r.evolve.candidates}
        for cid, passed in before.items():
            assert after.get(cid) == passed, f"candidate {cid} verified before the kill was lost"
        assert len(after) == 12
        info = await bus.js.stream_info(subjects.STREAM_VERIFY)
        # Each candidate's request once, plus at most the ones in flight at the kill
        # (two devices), which the dedupe window drops anyway.
        assert info.state.last_seq <= 12 + 2
        completed = []
        sub = await bus.js.subscribe(subjects.job_events(job_id), ordered_consumer=True)
        with contextlib.suppress(Exception):
            while True:
                msg = await sub.next_msg(timeout=scaled(0.5))
                if decode(msg.data, dict).get("event") == "completed":
                    completed.append(msg)
        await sub.unsubscribe()
        assert len(completed) == 1
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        stop.set()
        await asyncio.wait_for(asyncio.gather(worker, return_exceptions=True), 60)



# A matmul with an epilogue, small enough for the interpreter: the built-in coder writes
# one tl.dot kernel whose tiles, warps and stages the evolve search varies.
MATMUL_TASK = '''\
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, a, b):
        return torch.relu(a @ b) * 0.5


m = 24
k = 40
n = 20


def get_inputs():
    return [torch.randn(m, k), torch.randn(k, n)]


def get_init_inputs():
    return []
'''


async def test_evolve_job_tunes_a_matmul_schedules_launch_parameters(
        shared_services, settings: Settings, bus: Bus, gateway: str) -> None:
    """Evolve with the built-in coder on a matmul task: each candidate is the tl.dot
    kernel at another point of (block_m, block_n, block_k, num_warps, num_stages), the
    job record keeps every point tried with its verdict, and the best is verified."""
    settings = msgspec.structs.replace(settings, worker_devices="0,1")
    async with shared_services(settings, bus), httpx.AsyncClient(base_url=gateway,
                                                                  timeout=scaled(10)) as client:
        resp = await client.post("/api/v1/jobs/submit", json={
            "op_name": "matmul_relu", "task_desc": MATMUL_TASK, "backend": "cpu",
            "job_type": "evolve", "max_rounds": 2, "parallel_num": 3, "num_islands": 1,
            "migration_interval": 1, "elite_size": 2, "parent_selection_prob": 0.5,
            "trials": 1})
        assert resp.status_code == 200, resp.text
        record = await wait_terminal(client, resp.json()["job_id"], timeout_s=300)
    assert record["status"] == "completed", record["error"]
    candidates = record["evolve"]["candidates"]
    assert len(candidates) == 6
    tiles = set()
    for c in candidates:
        p = c["params"]
        tiles.add((p["block_m"], p["block_n"], p["block_k"], p["num_warps"], p["num_stages"]))
        assert c["passed"] is True, c
    assert len(tiles) >= 3, "the search must try several matmul launch configurations"
    best = record["result"]["best"][0]
    assert best["passed"] is True
    p = best["params"]
    launch = (f"BLOCK_M={p['block_m']}, BLOCK_N={p['block_n']}, BLOCK_K={p['block_k']}, "
              f"num_warps={p['num_warps']}, num_stages={p['num_stages']})")
    assert launch in best["code"] and "tl.dot(" in best["code"]
