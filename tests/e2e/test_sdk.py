"""The Python SDK: AIKGClient / AsyncAIKGClient over HTTP, RemoteWorker over NATS,
LocalWorker in-process, WorkerManager and Task (docs/compatibility.md).

Fast tests drive a served gateway with a fake worker heartbeat; the ``slow`` ones run
a real worker (and generator) as asyncio tasks in the test's loop, as test_e2e does.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from schemas import subjects
from services.common.bus import Bus
from services.common.settings import Settings
from services.sdk import (
    AIKGClient,
    AIKGConnectionError,
    AIKGHTTPError,
    AsyncAIKGClient,
    DevicePool,
    LocalWorker,
    NoWorkerError,
    RemoteWorker,
    Task,
    WorkerManager,
    get_worker_manager,
    register_local_worker,
    register_remote_worker,
)
from services.sdk import client as client_module
from tests.conftest import as_role
from tests.helpers import (
    BUNDLED_RELU_TASK,
    RELU_KERNEL,
    WRONG_RELU_KERNEL,
    scaled,
)

ROOT = Path(__file__).resolve().parents[2]
RELU = BUNDLED_RELU_TASK

GOOD_KERNEL = RELU_KERNEL
WRONG_KERNEL = WRONG_RELU_KERNEL


@pytest.fixture
async def cpu_worker(bus: Bus, fake_worker_heartbeat) -> None:
    await fake_worker_heartbeat(bus, "cpu", "x86_64")


@pytest.fixture
async def fresh_manager() -> AsyncIterator[WorkerManager]:
    """The process-wide manager, emptied (and its workers closed) after the test."""
    manager = get_worker_manager()
    yield manager
    await manager.close()


# --- AIKGClient / AsyncAIKGClient against a gateway ---------------------------------


async def test_client_calls_and_errors(gateway: str, cpu_worker: None, free_port) -> None:
    def script() -> dict:
        with AIKGClient(gateway) as client:
            job_id = client.submit_job(op_name="relu", task_desc=RELU, job_type="single",
                                       backend="cpu", arch="x86_64", dsl="triton_cuda",
                                       framework="torch", workflow="coder_only_workflow",
                                       shape_overrides={"batch_size": 2}, max_attempts=2)
            status = client.get_job_status(job_id)
            listing = client.list_jobs(status="pending", op_name="relu")
            kernel = client.get_kernel(job_id)
            cancelled = client.cancel_job(job_id)
            again = client.cancel_job(job_id)
            with pytest.raises(AIKGHTTPError) as missing:
                client.get_job_status("job-nope")
            with pytest.raises(AIKGHTTPError) as conflict:
                client.submit_job(op_name="relu", task_desc=RELU, backend="cuda", arch="h200")
            with pytest.raises(AIKGHTTPError) as bad:
                client.submit_job(op_name="relu", task_desc=RELU, max_rounds=0)
            workers = client.get_workers_status()
        with pytest.raises(AIKGConnectionError, match="cannot reach"):
            AIKGClient(f"http://127.0.0.1:{free_port()}").get_job_status("x")
        return dict(job_id=job_id, status=status, listing=listing, kernel=kernel,
                    cancelled=cancelled, again=again, missing=missing.value,
                    conflict=conflict.value, bad=bad.value, workers=workers)

    r = await asyncio.to_thread(script)
    assert r["status"]["status"] == "pending"
    assert r["status"]["request"]["shape_overrides"] == {"batch_size": 2}
    assert r["status"]["request"]["max_attempts"] == 2
    assert [j["job_id"] for j in r["listing"]["jobs"]] == [r["job_id"]]
    assert r["kernel"] is None
    assert r["cancelled"]["status"] == r["again"]["status"] == "cancelled"
    assert r["missing"].status_code == 404 and "job-nope" in r["missing"].detail
    assert r["conflict"].status_code == 409 and r["conflict"].body["live"] == ["cpu/x86_64"]
    assert r["bad"].status_code == 400 and "max_rounds" in r["bad"].detail
    assert r["workers"]["workers"][0]["backend"] == "cpu"


async def test_token_from_argument_or_environment(start_gateway, settings: Settings, bus: Bus,
                                                  fake_worker_heartbeat, monkeypatch) -> None:
    import msgspec

    await fake_worker_heartbeat(bus)
    url = await start_gateway(msgspec.structs.replace(settings, api_token="s3"))
    monkeypatch.delenv("AIKG_API_TOKEN", raising=False)

    def calls() -> tuple[int, int, int]:
        with pytest.raises(AIKGHTTPError) as no:
            AIKGClient(url).list_jobs()
        with_arg = AIKGClient(url, token="s3").list_jobs()["total"]
        os.environ["AIKG_API_TOKEN"] = "s3"
        try:
            with_env = AIKGClient(url).list_jobs()["total"]
        finally:
            del os.environ["AIKG_API_TOKEN"]
        return no.value.status_code, with_arg, with_env

    assert await asyncio.to_thread(calls) == (401, 0, 0)


async def test_wait_for_completion_cancels_on_ctrl_c_and_times_out(
    gateway: str, bus: Bus, cpu_worker: None, monkeypatch
) -> None:
    def interrupted(_seconds: float) -> None:
        raise KeyboardInterrupt

    def run() -> tuple[str, str]:
        with AIKGClient(gateway) as client:
            waiting = client.submit_job(op_name="relu", task_desc=RELU)
            with pytest.raises(TimeoutError, match="did not finish within 0.3 s"):
                client.wait_for_completion(waiting, timeout=0.3, poll_interval=0.1)
            job_id = client.submit_job(op_name="relu", task_desc=RELU)
            monkeypatch.setattr(client_module.time, "sleep", interrupted)
            with pytest.raises(KeyboardInterrupt):
                client.wait_for_completion(job_id, timeout=scaled(60))
            return waiting, job_id

    waiting, job_id = await asyncio.to_thread(run)
    assert json.loads((await bus.jobs.get(job_id)).value)["status"] == "cancelled"
    assert json.loads((await bus.jobs.get(waiting)).value)["status"] == "pending"


async def test_async_client_streams_events_and_cancels_on_task_cancel(
    gateway: str, bus: Bus, cpu_worker: None
) -> None:
    async with AsyncAIKGClient(gateway) as client:
        job_id = await client.submit_job(op_name="relu", task_desc=RELU, backend="cpu")
        seen: list[dict] = []

        async def follow() -> None:
            async for event in client.stream_events(job_id):
                seen.append(event)

        follower = asyncio.create_task(follow())
        waiter = asyncio.create_task(client.wait_for_completion(job_id, poll_interval=0.1))
        while not seen:
            await asyncio.sleep(0.05)
        waiter.cancel()  # like Ctrl-C in an asyncio program: the job is cancelled
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await asyncio.wait_for(follower, 10)
        assert [e["event"] for e in seen] == ["submitted", "cancelled"]
        assert all(e["job_id"] == job_id and isinstance(e["seq"], int) for e in seen)
        assert (await client.get_job_status(job_id))["status"] == "cancelled"
        assert (await client.list_jobs(status="cancelled"))["total"] == 1
        with pytest.raises(AIKGHTTPError) as missing:
            async for _ in client.stream_events("job-nope"):
                pass
        assert missing.value.status_code == 404


# --- WorkerManager, RemoteWorker and Task without a worker process ------------------


class _Dummy:
    def __init__(self, backend: str, arch: str | None, in_flight: int, capacity: int) -> None:
        self.backend, self.arch, self._in_flight, self._capacity = backend, arch, in_flight, capacity
        self.closed = False

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def capacity(self) -> int:
        return self._capacity

    async def close(self) -> None:
        self.closed = True


async def test_worker_manager_selects_least_loaded() -> None:
    manager = WorkerManager()
    busy = _Dummy("cuda", "a100", in_flight=3, capacity=4)
    idle = _Dummy("cuda", "a100", in_flight=1, capacity=4)
    other = _Dummy("ascend", "ascend910b4", in_flight=0, capacity=1)
    for w in (busy, idle, other):
        await manager.register(w)
    assert manager.select("cuda", "a100") is idle
    assert manager.select("cuda") is idle
    idle._in_flight = 4
    assert manager.select("cuda", "a100") is busy
    await manager.register(busy, "cuda", "a100", capacity=100)  # re-registering replaces
    assert len(manager.registrations) == 3 and manager.select("cuda") is busy
    with pytest.raises(NoWorkerError, match="no worker registered for cpu/x86_64.*ascend/"
                                            "ascend910b4, cuda/a100.*register_local_worker"):
        manager.select("cpu", "x86_64")
    await manager.close()
    assert busy.closed and other.closed and manager.registrations == []


def test_remote_worker_wants_a_nats_url(monkeypatch) -> None:
    monkeypatch.delenv("AIKG_NATS_URL", raising=False)
    with pytest.raises(ValueError, match="AIKG_NATS_URL"):
        RemoteWorker(backend="cpu")
    with pytest.raises(ValueError, match="reached through NATS"):
        RemoteWorker("http://localhost:9001", backend="cpu")
    monkeypatch.setenv("AIKG_NATS_URL", "nats://127.0.0.1:4222")
    worker = RemoteWorker(backend="cpu")
    assert worker.nats_url == "nats://127.0.0.1:4222"
    assert repr(worker) == "RemoteWorker('nats://127.0.0.1:4222', backend='cpu', arch=None)"
    assert worker.in_flight == 0


async def test_task_device_pool_is_deprecated_and_registers_one_local_worker(
    fresh_manager: WorkerManager
) -> None:
    with pytest.warns(DeprecationWarning, match="register_local_worker"):
        Task(op_name="relu", task_desc=RELU, task_id="t1", dsl="triton_cuda", backend="cpu",
             arch="x86_64", config={}, device_pool=DevicePool([0, 1]), framework="torch")
    with pytest.warns(DeprecationWarning):
        Task(op_name="relu", task_desc=RELU, task_id="t2", backend="cpu",
             device_pool=DevicePool([0, 1]))
    (registration,) = fresh_manager.registrations
    assert isinstance(registration.worker, LocalWorker)
    assert (registration.worker.devices, registration.capacity) == (["0", "1"], 2)
    assert repr(registration.worker).startswith("LocalWorker(devices=['0', '1'], backend='cpu'")
    with pytest.raises(ValueError, match="workflow"):
        Task(op_name="relu", task_desc=RELU, task_id="t3", workflow="magic")


async def test_remote_registration_reads_capacity_from_live_workers(
    nats_url: str, settings: Settings, bus: Bus, fake_worker_heartbeat,
    fresh_manager: WorkerManager
) -> None:
    # The SDK connects with a generator's rights (verify.>, RESULTS, workers bucket).
    client = as_role(settings, "generator")
    none = await register_remote_worker(backend="cuda", arch="h200", nats_url=nats_url,
                                        settings=client)
    assert fresh_manager.registrations[-1].capacity == 1
    with pytest.raises(NoWorkerError, match="no live AIKG worker for cuda/h200"):
        await none.verify(RELU, GOOD_KERNEL, "relu")

    await fake_worker_heartbeat(bus, "cuda", "h200", worker_id="g1", devices=["0", "1"], capacity=2)
    await fake_worker_heartbeat(bus, "cuda", "h200", worker_id="g2", devices=["0", "1", "2"],
                                capacity=3)
    await fake_worker_heartbeat(bus, "cuda", "a100", worker_id="g3", capacity=8)
    worker = await register_remote_worker(backend="cuda", arch="h200", worker_url=nats_url,
                                          settings=client)
    assert fresh_manager.registrations[-1].capacity == 5
    status = await worker.status()
    assert (status["capacity"], status["devices"]) == (5, 5)
    assert [w["worker_id"] for w in status["workers"]] == ["g1", "g2"]
    assert status["workers"][0]["leases"] is None  # fake workers answer no status request
    with pytest.raises(ValueError, match="op_name"):
        await worker.verify(RELU, GOOD_KERNEL, "not a valid name!")


# --- against real services (slow) ----------------------------------------------------

REFERENCE_SCRIPT = '''
from services.sdk import AIKGClient  # was: from ai_kernel_generator.client.aikg_client import AIKGClient

client = AIKGClient("{url}")

# Submit single job
job_id = client.submit_job(
    op_name="relu",
    task_desc={task!r},
    job_type="single",
    backend="cpu",
    arch="{arch}",
    dsl="triton",
    framework="torch",
    workflow="coder_only_workflow"
)

# Wait for completion
status = client.wait_for_completion(job_id, timeout=240)
print(f"Job status: {{status['status']}}")
print(f"Result: {{status.get('result')}}")
print(f"JOB_ID={{job_id}}")
'''


@pytest.mark.slow
async def test_reference_client_script_and_event_streams_on_real_stack(
    shared_services, settings: Settings, bus: Bus, gateway: str, tmp_path: Path
) -> None:
    """The reference document's client script, import line changed, against a real
    gateway + generator + worker; then SSE: live events of a running job, and the
    whole history of a finished one for a fresh subscriber."""
    async with shared_services(settings, bus):
        script = tmp_path / "reference_client.py"
        script.write_text(REFERENCE_SCRIPT.format(url=gateway, task=RELU, arch=settings.arch))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(script), cwd=ROOT, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
        out, err = await asyncio.wait_for(proc.communicate(), 280)
        assert proc.returncode == 0, err.decode()
        assert "Job status: completed" in out.decode(), out.decode()
        assert "'passed': True" in out.decode()
        first_job = out.decode().split("JOB_ID=")[1].strip()

        async with AsyncAIKGClient(gateway) as client:
            # Live: subscribe right after submitting a job that takes seconds to run.
            job_id = await client.submit_job(op_name="sigmoid",
                                             task_desc=(ROOT / "tasks/sigmoid.py").read_text(),
                                             backend="cpu")
            live: list[tuple[str, str]] = []
            async for event in client.stream_events(job_id):
                status = (await client.get_job_status(job_id))["status"]
                live.append((event["event"], status))
            kinds = [k for k, _ in live]
            assert kinds[0] == "submitted" and kinds[-1] == "completed", kinds
            for kind in ("started", "candidate_generated", "verify_started", "verify_result"):
                assert kind in kinds
            assert live[0][1] in ("pending", "running")  # seen before the job ended

            # History: a fresh subscriber of a finished job gets everything, then the end.
            history = [e async for e in client.stream_events(first_job)]
            assert [e["event"] for e in history][0] == "submitted"
            assert history[-1]["event"] == "completed"
            assert history[-1]["verdict"]["passed"] is True
            replay = [e async for e in client.stream_events(job_id)]
            assert [e["event"] for e in replay] == kinds
            kernel = await client.get_kernel(first_job)
            assert kernel is not None and "@triton.jit" in kernel


@pytest.mark.slow
async def test_worker_only_mode_remote_worker_and_task(
    shared_services, settings: Settings, bus: Bus, nats_url: str, fresh_manager: WorkerManager
) -> None:
    """RemoteWorker against a real worker (no gateway, no generator): verify, profile,
    status with leases, capacity from the worker, and Task.run with local generation."""
    async with shared_services(settings, bus, generator=False):
        worker = await register_remote_worker(backend="cpu", arch=settings.arch,
                                              nats_url=nats_url,
                                              settings=as_role(settings, "generator"))
        assert fresh_manager.registrations[0].capacity == 1

        good, bad = await asyncio.gather(worker.verify(RELU, GOOD_KERNEL, "relu"),
                                         worker.verify(RELU, WRONG_KERNEL, "relu", trials=1))
        assert good.passed and good.stage is None and good.interpreted
        assert good.worker_id and good.job_id.startswith("sdk-")
        assert not bad.passed and bad.stage == "mismatch"
        profiled = await worker.profile(RELU, GOOD_KERNEL, "relu", trials=1)
        assert profiled.passed and profiled.speedup is None  # cpu: no meaningful timings

        status = await worker.status()
        (info,) = status["workers"]
        assert info["backend"] == "cpu" and info["leases"] == []
        assert status["capacity"] == 1

        op_name, passed, info = await Task(
            op_name="relu", task_desc=RELU, task_id="test_task_001", dsl="triton_cuda",
            backend="cpu", arch=settings.arch, config={}, framework="torch",
            workflow="coder_only_workflow").run()
        assert (op_name, passed) == ("relu", True), info["error"]
        assert info["coder"] == "builtin" and info["verdict"]["passed"] is True
        assert info["verdict"]["candidate_id"] == "test_task_001-1"
        # Verify requests of worker-only mode leave no job records behind.
        with pytest.raises(Exception):  # noqa: B017 - NoKeysError: the bucket is empty
            await bus.jobs.keys()
        assert (await bus.js.stream_info(subjects.STREAM_VERIFY)).state.messages == 0


@pytest.mark.slow
async def test_local_mode_local_worker_and_task(fresh_manager: WorkerManager,
                                                monkeypatch) -> None:
    """LocalWorker and Task with no NATS at all: the candidate runs in this process's
    sandbox, the built-in coder in a child process."""
    monkeypatch.delenv("AIKG_NATS_URL", raising=False)
    worker = await register_local_worker([0, 1], backend="cpu")
    assert await worker.capacity() == 2
    good, bad = await asyncio.gather(worker.verify(RELU, GOOD_KERNEL, "relu", trials=1),
                                     worker.verify(RELU, "x = 1\n", "relu"))
    assert good.passed and good.device in ("0", "1")
    assert not bad.passed and bad.stage in ("static", "compile")
    assert worker.in_flight == 0

    # init_code that fails, then the built-in coder's kernel passes: two attempts.
    op_name, passed, info = await Task(
        op_name="relu", task_desc=RELU, task_id="local-1", backend="cpu",
        init_code=WRONG_KERNEL, shape_overrides={"batch_size": 4}).run()
    assert passed, info["error"]
    assert (info["attempts"], info["coder"]) == (2, "builtin")

    op_name, passed, info = await Task(op_name="nothing", task_desc="x = 1\n",
                                       task_id="local-2", backend="cpu").run()
    assert not passed and "get_inputs" in info["error"] and info["attempts"] == 0


def test_sdk_import_is_light() -> None:
    """Importing the SDK (for AIKGClient) does not import torch."""
    code = "import sys, services.sdk; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                                       capture_output=True, text=True, timeout=scaled(60))
    assert out.stdout.strip() == "False", out.stderr
