"""``aikg list``, ``cancel``, ``events``, ``workers`` and ``run``, as a user runs them:
subprocesses against a gateway served in the test's loop (``run``: against nothing)."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from schemas import JobEvent, JobResult, VerifyResult, encode
from services.common.bus import Bus, JobStore
from services.common.jobs import publish_event
from tests.helpers import scaled

ROOT = Path(__file__).resolve().parents[2]
_SCRIPT = Path(sys.executable).parent / "aikg"
AIKG = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "services.cli"]


async def aikg(*args: str, env: dict[str, str] | None = None, timeout: float = 60.0,
               prefix: list[str] | None = None) -> tuple[int, str, str]:
    """Run ``aikg ARGS`` (with no AIKG_* of ours) without blocking the loop."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("AIKG_")}
    proc = await asyncio.create_subprocess_exec(
        *(prefix or []), *AIKG, *args, env={**clean, "COLUMNS": "200", **(env or {})},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT)
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    return proc.returncode, out.decode(), err.decode()


@pytest.fixture
async def cpu_worker(bus: Bus, fake_worker_heartbeat) -> None:
    await fake_worker_heartbeat(bus, "cpu", "x86_64", worker_id="w-cpu", devices=["0", "1"],
                                capacity=2, in_flight=1)


async def _submit(gateway: str, relu_task: str, **fields) -> str:
    import httpx

    async with httpx.AsyncClient(base_url=gateway) as c:
        r = await c.post("/api/v1/jobs", json={"op_name": "relu", "task_desc": relu_task,
                                               **fields})
        assert r.status_code == 200, r.text
        return r.json()["job_id"]


async def _complete(bus: Bus, job_id: str) -> None:
    def change(rec):
        rec.status = "completed"
        rec.end_time = dt.datetime.now(dt.UTC)
        rec.result = JobResult(passed=True, code="# kernel\n", attempts=1, verdict=VerifyResult(
            request_id="r", job_id=job_id, candidate_id="c", worker_id="w", device="0",
            passed=True))
        return rec

    await JobStore(bus.jobs).update(job_id, change)
    await publish_event(bus, JobEvent(job_id=job_id, event="completed", status="completed"))


async def test_help_answers_the_question() -> None:
    code, out, _ = await aikg("--help")
    assert code == 0
    for word in ("list", "cancel", "events", "workers", "run", "Exit codes"):
        assert word in out
    for command, words in (("list", ["--status", "--op-name", "--limit", "--json"]),
                           ("cancel", ["JOB_ID", "already ended"]),
                           ("events", ["JOB_ID", "--json", "live"]),
                           ("workers", ["load", "leases"]),
                           ("run", ["--backend", "--shape", "--json", "no NATS", "Exit codes"])):
        code, out, _ = await aikg(command, "--help")
        assert code == 0, command
        for word in words:
            assert word.lower() in out.lower(), (command, word)
        # Flags take no value, so no type is shown after them; valued options keep theirs.
        assert "<bool>" not in out, (command, out)
    code, out, _ = await aikg("submit", "-h")
    wait_line = next(line for line in out.splitlines() if line.startswith("│ --wait "))
    assert "<" not in wait_line and "Follow the job" in wait_line
    assert "<float>" in next(line for line in out.splitlines() if line.startswith("│ --timeout"))


async def test_list_cancel_workers(gateway: str, bus: Bus, cpu_worker: None,
                                   relu_task: str) -> None:
    first = await _submit(gateway, relu_task, job_id="first-job")
    second = await _submit(gateway, relu_task, job_id="second-job", op_name="gelu")
    await _complete(bus, first)

    code, out, err = await aikg("list", "--gateway", gateway)
    assert code == 0, err
    assert out.index("second-job") < out.index("first-job")  # newest first
    assert "completed" in out and "pending" in out and "cpu/x86_64" in out
    code, out, _ = await aikg("list", "--status", "pending", "--json", "--gateway", gateway)
    assert [j["job_id"] for j in json.loads(out)["jobs"]] == [second]
    code, out, err = await aikg("list", "--limit", "1", "--gateway", gateway)
    assert code == 0 and "second-job" in out and "first-job" not in out
    assert "--offset 1" in err
    code, _, err = await aikg("list", "--status", "done", "--gateway", gateway)
    assert code == 2 and "400" in err

    code, out, _ = await aikg("cancel", second, "--gateway", gateway)
    assert code == 0 and f"{second} cancelled" in out
    code, out, _ = await aikg("cancel", first, "--gateway", gateway)
    assert code == 0 and "already ended: completed" in out
    code, _, err = await aikg("cancel", "job-nope", "--gateway", gateway)
    assert code == 2 and "job-nope" in err

    await bus.leases.put("w-cpu.1", encode({"worker_id": "w-cpu", "device": "1",
                                            "job_id": "job-z", "request_id": "req-z"}))
    code, out, err = await aikg("workers", "--gateway", gateway)
    assert code == 0, err
    assert "w-cpu" in out and "cpu/x86_64" in out and "1/2" in out and "1:job-z" in out
    assert "[0, 1]" in out  # the device list, not a count
    code, out, _ = await aikg("workers", "--json", "--gateway", gateway)
    assert json.loads(out)["workers"][0]["load"] == 0.5


# A kernel as a job leaves it, without a trailing newline: a file or a pipe gets one.
KERNEL = "import triton\n\n@triton.jit\ndef relu_kernel(x_ptr):\n    pass"


async def _complete_with(bus: Bus, job_id: str, code: str, passed: bool = True) -> None:
    def change(rec):
        rec.status = "completed" if passed else "failed"
        rec.end_time = dt.datetime.now(dt.UTC)
        rec.result = JobResult(passed=passed, code=code, attempts=1, coder="builtin",
                               verdict=VerifyResult(
                                   request_id="r", job_id=job_id, candidate_id="c",
                                   worker_id="w", device="0", passed=passed,
                                   stage=None if passed else "mismatch", max_abs_error=1e-7,
                                   max_rel_error=3.5, rel_l2_error=2e-6, atol=1e-4,
                                   rtol=1e-4, interpreted=True, duration_s=0.4))
        return rec

    await JobStore(bus.jobs).update(job_id, change)


async def test_the_kernel_goes_to_a_file_or_plain_down_a_pipe(
        gateway: str, bus: Bus, cpu_worker: None, relu_task: str, tmp_path: Path) -> None:
    """`status -o FILE` and `kernel JOB -o FILE` write the kernel's exact source; piped,
    `status` and `kernel` print it alone (the record goes to stderr)."""
    pending = await _submit(gateway, relu_task)
    code, out, err = await aikg("kernel", pending, "--gateway", gateway)
    assert code == 5 and out == "" and "no kernel yet" in err, err
    job = await _submit(gateway, relu_task)
    await _complete_with(bus, job, KERNEL)

    path = tmp_path / "kernel.py"
    code, out, err = await aikg("status", job, "-o", str(path), "--gateway", gateway)
    assert code == 0, err
    assert path.read_bytes() == (KERNEL + "\n").encode()
    assert f"kernel written to {path}" in err
    assert "completed" in out and "relu_kernel" not in out  # the record, no kernel panel
    # The pass says which figures decided it.
    assert "max rel 3.5 > rtol 0.0001 only where |ref| is small" in out, out

    code, out, err = await aikg("status", job, "--gateway", gateway)
    assert code == 0 and out == KERNEL + "\n", out
    assert "completed" in err and "verdict" in err

    code, out, err = await aikg("kernel", job, "--gateway", gateway)
    assert code == 0 and out == KERNEL + "\n" and err == "", err
    other = tmp_path / "other.py"
    code, out, err = await aikg("kernel", job, "--output", str(other), "--gateway", gateway)
    assert code == 0 and out == "" and other.read_text() == KERNEL + "\n"

    failed = await _submit(gateway, relu_task)
    await _complete_with(bus, failed, KERNEL, passed=False)
    code, out, err = await aikg("kernel", failed, "--gateway", gateway)
    assert code == 1 and out == KERNEL + "\n" and "did NOT pass" in err and "mismatch" in err
    code, _, err = await aikg("kernel", "job-nope", "--gateway", gateway)
    assert code == 2 and "job-nope" in err


async def test_submit_wait_o_writes_the_kernel(gateway: str, bus: Bus, cpu_worker: None,
                                               relu_task: str, tmp_path: Path) -> None:
    task = tmp_path / "relu.py"
    task.write_text(relu_task)

    async def finish() -> None:
        while not await _any_job(bus):
            await asyncio.sleep(0.1)
        await _complete_with(bus, (await bus.jobs.keys())[0], KERNEL)

    path = tmp_path / "out" / "kernel.py"
    code, _, err = await aikg("submit", str(task), "--wait", "-o", str(path),
                              "--gateway", gateway)
    assert code == 2 and "does not exist" in err  # before anything is submitted
    assert not await _any_job(bus)
    path.parent.mkdir()
    finisher = asyncio.create_task(finish())
    code, out, err = await aikg("submit", str(task), "--wait", "-o", str(path),
                                "--gateway", gateway)
    await finisher
    assert code == 0, err
    assert path.read_text() == KERNEL + "\n" and f"kernel written to {path}" in err
    assert "completed" in out
    code, _, err = await aikg("submit", str(task), "-o", str(path), "--gateway", gateway)
    assert code == 2 and "--wait" in err


async def _any_job(bus: Bus) -> bool:
    try:
        return bool(await bus.jobs.keys())
    except Exception:  # noqa: BLE001 - NoKeysError while the bucket is empty
        return False


async def test_events_tail_exit_codes(gateway: str, bus: Bus, cpu_worker: None,
                                      relu_task: str) -> None:
    done = await _submit(gateway, relu_task)
    await publish_event(bus, JobEvent(job_id=done, event="started", status="running",
                                      message="on its way"))
    await _complete(bus, done)
    code, out, err = await aikg("events", done, "--gateway", gateway)
    assert code == 0, err
    lines = out.strip().splitlines()
    assert [line.split()[1] for line in lines] == ["submitted", "started", "completed"]
    assert "on its way" in lines[1]

    live = await _submit(gateway, relu_task)
    follower = asyncio.create_task(aikg("events", live, "--json", "--gateway", gateway))
    # The gateway reads the job's events from the stream in order (a subscription only
    # wakes it), so what is published before or after the follower connects reaches it
    # alike, in order.
    await asyncio.sleep(0.5)
    assert not follower.done(), await follower
    await publish_event(bus, JobEvent(job_id=live, event="started", status="running"))
    import httpx

    async with httpx.AsyncClient(base_url=gateway) as c:
        assert (await c.post(f"/api/v1/jobs/{live}/cancel")).status_code == 200
    code, out, err = await asyncio.wait_for(follower, 30)
    assert code == 1, err  # cancelled
    events = [json.loads(line) for line in out.strip().splitlines()]
    assert [e["event"] for e in events] == ["submitted", "started", "cancelled"]
    assert all(isinstance(e["seq"], int) for e in events)

    code, _, err = await aikg("events", "job-nope", "--gateway", gateway)
    assert code == 2 and "job-nope" in err


async def test_client_commands_without_gateway_exit_3(free_port) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    for args in (("list",), ("workers",), ("cancel", "job-x"), ("events", "job-x")):
        code, _, err = await aikg(*args, "--gateway", url)
        assert code == 3, (args, err)
        assert "gateway" in err


async def test_run_refuses_bad_input_with_exit_2(tmp_path: Path) -> None:
    code, _, err = await aikg("run", str(tmp_path / "missing.py"))
    assert code == 2 and "missing.py" in err
    not_a_task = tmp_path / "x.py"
    not_a_task.write_text("x = 1\n")
    code, _, err = await aikg("run", str(not_a_task))
    assert code == 2 and "get_inputs" in err
    code, _, err = await aikg("run", str(ROOT / "tasks/relu.py"), "--backend", "tpu")
    assert code == 2 and "tpu" in err


def _no_network_prefix() -> list[str]:
    """``unshare -n`` (no network at all, loopback down) where this machine permits it."""
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "-n", "true"], capture_output=True).returncode == 0:
        return [unshare, "-n"]
    return []


@pytest.mark.slow
async def test_run_verifies_relu_with_no_nats_and_no_network() -> None:
    """`aikg run tasks/relu.py`: no nats-server, AIKG_NATS_URL unset, and (where the
    machine permits) no network namespace at all."""
    prefix = _no_network_prefix()
    code, out, err = await aikg("run", "tasks/relu.py", "--shape", "batch_size=8",
                                timeout=scaled(240), prefix=prefix)
    assert code == 0, err
    # Piped: the kernel's plain source alone on stdout, the verdict on stderr.
    assert "passed" in err and "not passed" not in err
    assert "@triton.jit" in out and "class ModelNew" in out and "│" not in out
    compile(out, "kernel.py", "exec")
    assert "interpreter" in err  # cpu: correctness only, said so
    assert "TRITON_DEFAULT_FP_FUSION" not in out + err  # pinned by the sandbox: no warning
    # Not a terminal: the phases as plain lines on stderr as they happened, in order.
    phases = re.findall(r"^\[\s*[\d.]+ s\] (.+)$", err, re.MULTILINE)
    for later, earlier in (("reference", "lowering"), ("trial 1 of 3", "reference"),
                           ("trial 3 of 3", "trial 1 of 3"), ("compile check", "trial 3 of 3"),
                           ("verdict", "compile check")):
        assert earlier in phases and later in phases, phases
        assert phases.index(earlier) < phases.index(later), phases
    assert "sandbox start" in phases, phases


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_verify_checks_your_own_kernel(tmp_path: Path) -> None:
    from tests.helpers import RELU_KERNEL

    task, small = str(ROOT / "tasks/relu.py"), ["--shape", "batch_size=2", "--shape", "dim=96"]
    good = tmp_path / "good.py"
    good.write_text(RELU_KERNEL)
    code, out, err = await aikg("verify", task, str(good), *small, "--trials", "1", "--json",
                                timeout=scaled(240))
    assert code == 0, err
    result = json.loads(out)
    assert result["passed"] and result["trials"] == 1 and result["stage"] is None, result
    assert not re.search(r"^\[\s*[\d.]+ s\]", err, re.MULTILINE), err  # --json: no phases

    # A kernel that hands tensor data to numpy: refused, with the line and the reason.
    bad = tmp_path / "bad.py"
    bad.write_text(RELU_KERNEL + "\n\ndef peek(t):\n    return t.numpy()\n")
    code, out, err = await aikg("verify", task, str(bad), *small, timeout=scaled(240))
    assert code == 1, err
    assert "not passed" in out or "static" in out, out
    assert ".numpy used (it hands tensor data to numpy or Python" in out, out

    code, _, err = await aikg("verify", task, str(tmp_path / "missing.py"))
    assert code == 2 and "missing.py" in err, err
