"""``aikg`` as a user runs it: subprocesses against a gateway served in the test's loop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
from pathlib import Path

import httpx
import pytest

from schemas import JobResult, VerifyResult
from services.common.bus import Bus, JobStore, connect_bus
from services.common.jobs import live_arch
from services.common.runtime import OWNER_FILE, descendants, running
from services.common.settings import Settings, load_settings
from services.common.task_source import parse_shape, task_module_names
from tests.helpers import poll_until, scaled
from tests.prometheus_check import prometheus_binary, scraped_health

_SCRIPT = Path(sys.executable).parent / "aikg"
AIKG = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "services.cli"]


async def aikg(*args: str, env: dict[str, str] | None = None, timeout: float = 30.0
               ) -> tuple[int, str, str]:
    """Run ``aikg ARGS`` without blocking the loop (the gateway serves in it)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("AIKG_")}
    proc = await asyncio.create_subprocess_exec(
        *AIKG, *args, env={**clean, "COLUMNS": "200", **(env or {})},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[2],
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    return proc.returncode, out.decode(), err.decode()


@pytest.fixture
def task_file(tmp_path: Path, relu_task: str) -> Path:
    path = tmp_path / "relu.py"
    path.write_text(relu_task)
    return path


@pytest.fixture
async def cpu_worker(bus: Bus, fake_worker_heartbeat) -> None:
    await fake_worker_heartbeat(bus, "cpu", "x86_64")


async def test_help() -> None:
    code, out, _ = await aikg("--help")
    assert code == 0
    for word in ("submit", "status", "up", "gateway", "worker", "generator", "AIKG_NATS_URL"):
        assert word in out
    code, out, _ = await aikg("submit", "--help")
    assert code == 0
    for word in ("--shape", "--wait", "--backend", "--json", "--timeout", "AIKG_GATEWAY_URL",
                 "AIKG_API_TOKEN"):
        assert word in out


def test_parse_shape() -> None:
    assert parse_shape("batch_size=16") == ("batch_size", 16)
    assert parse_shape("eps=1e-5") == ("eps", 1e-5)
    assert parse_shape("causal=true") == ("causal", True)
    assert parse_shape("mode=fast") == ("mode", "fast")


def test_parse_shape_reads_python_literals() -> None:
    assert parse_shape("input_shape=(64,)") == ("input_shape", (64,))
    assert parse_shape("kernel = [3, 5]") == ("kernel", (3, 5))
    assert parse_shape("offset=-3") == ("offset", -3)
    assert parse_shape("margin=0.5") == ("margin", 0.5)
    assert parse_shape("affine=True") == ("affine", True)
    assert parse_shape("mode='mean'") == ("mode", "mean")
    assert type(parse_shape("batch_size=16")[1]) is int
    for bad in ("scale=(0.5, 2.0)", "sizes={'a': 1}", "dim=None", "nested=((1, 2),)"):
        with pytest.raises(ValueError, match="tuple of ints"):
            parse_shape(bad)


def test_task_module_names_are_found_without_running_the_task() -> None:
    source = (
        "import torch\n"
        "batch_size = 16\n"
        "input_shape: tuple = (4096,)\n"
        "a, (b, *c) = 1, (2, 3)\n"
        "if batch_size > 1:\n"
        "    dim = 8\n"
        "def get_inputs():\n"
        "    hidden = 3\n"
        "    return []\n"
        "raise SystemExit('a task must not run in the CLI')\n"
    )
    assert task_module_names(source) == ["batch_size", "input_shape", "a", "b", "c", "dim"]


async def test_unknown_shape_name_is_exit_2_before_any_work(
    task_file: Path, free_port
) -> None:
    # An unreachable gateway: exit 2, not 3, shows the check ran before any request.
    url = f"http://127.0.0.1:{free_port()}"
    code, _, err = await aikg("submit", str(task_file), "--gateway", url,
                              "--shape", "batch=16")
    assert code == 2
    assert "batch" in err and "batch_size, dim" in err
    code, _, err = await aikg("run", str(task_file), "--shape", "dim=64",
                              "--shape", "input_shape=(64,)")
    assert code == 2
    assert "input_shape" in err and "batch_size, dim" in err
    code, _, err = await aikg("run", str(task_file), "--shape", "dim=(0.5, 1.5)")
    assert code == 2
    assert "tuple of ints" in err


async def test_submit_sends_tuple_shape_overrides(
    gateway: str, bus: Bus, cpu_worker: None, tmp_path: Path, relu_task: str
) -> None:
    path = tmp_path / "relu_shape.py"
    path.write_text(relu_task.replace("dim = 1024", "dim = 1024\ninput_shape = (1024,)")
                    .replace("torch.randn(batch_size, dim)", "torch.randn(batch_size, *input_shape)"))
    code, out, err = await aikg("submit", str(path), "--gateway", gateway,
                                "--shape", "input_shape=(64,)", "--shape", "batch_size=2")
    assert code == 0, err
    record = json.loads((await bus.jobs.get(out.strip())).value)
    assert record["request"]["shape_overrides"] == {"input_shape": [64], "batch_size": 2}


async def test_submit_prints_job_id_with_shape_overrides(
    gateway: str, bus: Bus, cpu_worker: None, task_file: Path
) -> None:
    code, out, err = await aikg("submit", str(task_file), "--gateway", gateway,
                                "--shape", "batch_size=16", "--shape", "dim=4096")
    assert code == 0, err
    job_id = out.strip()
    assert job_id.startswith("job-")
    record = json.loads((await bus.jobs.get(job_id)).value)
    assert record["op_name"] == "relu"
    overrides = record["request"]["shape_overrides"]
    assert overrides == {"batch_size": 16, "dim": 4096}
    assert all(type(v) is int for v in overrides.values())
    assert f"aikg status {job_id}" in err  # where to go next, on stderr (stdout: the id)


async def test_submit_passes_every_evolve_parameter(
    gateway: str, bus: Bus, cpu_worker: None, task_file: Path
) -> None:
    code, out, err = await aikg(
        "submit", str(task_file), "--gateway", gateway, "--job-type", "evolve",
        "--max-rounds", "3", "--parallel-num", "4", "--num-islands", "2",
        "--migration-interval", "1", "--elite-size", "2", "--parent-selection-prob", "0.25",
        "--max-attempts", "5")
    assert code == 0, err
    request = json.loads((await bus.jobs.get(out.strip())).value)["request"]
    assert {k: request[k] for k in ("job_type", "max_rounds", "parallel_num", "num_islands",
                                    "migration_interval", "elite_size",
                                    "parent_selection_prob", "max_attempts")} == {
        "job_type": "evolve", "max_rounds": 3, "parallel_num": 4, "num_islands": 2,
        "migration_interval": 1, "elite_size": 2, "parent_selection_prob": 0.25,
        "max_attempts": 5}
    code, _, err = await aikg("submit", str(task_file), "--gateway", gateway,
                              "--parent-selection-prob", "1.5")
    assert code == 2 and "parent_selection_prob" in err


async def test_submit_json_and_status(gateway: str, cpu_worker: None, task_file: Path) -> None:
    code, out, err = await aikg("submit", str(task_file), "--json", "--op-name", "my_relu",
                                env={"AIKG_GATEWAY_URL": gateway})
    assert code == 0, err
    job_id = json.loads(out)["job_id"]
    code, out, _ = await aikg("status", job_id, "--json", "--gateway", gateway)
    assert code == 5  # still pending: no generator runs here
    record = json.loads(out)
    assert (record["job_id"], record["op_name"], record["status"]) == (job_id, "my_relu", "pending")


async def test_submit_wait_renders_verdict_and_kernel(
    gateway: str, bus: Bus, cpu_worker: None, task_file: Path
) -> None:
    """--wait follows the record until it ends; the generator is played by the test."""
    kernel = "import triton\n\n@triton.jit\ndef relu_kernel(x_ptr):\n    pass\n"

    async def finish_when_submitted() -> None:
        store = JobStore(bus.jobs)
        while not (keys := await _keys(bus)):
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.6)

        def complete(rec):
            rec.status = "completed"
            rec.result = JobResult(passed=True, code=kernel, attempts=1, coder="builtin",
                                   verdict=VerifyResult(
                                       request_id="r1", job_id=rec.job_id, candidate_id="c1",
                                       worker_id="w1", device="0", passed=True,
                                       max_abs_error=1e-7, atol=1e-5, rtol=1e-5,
                                       interpreted=True, duration_s=0.4))
            return rec

        await store.update(keys[0], complete)

    finisher = asyncio.create_task(finish_when_submitted())
    code, out, err = await aikg("submit", str(task_file), "--wait", "--gateway", gateway)
    await finisher
    assert code == 0, err
    # Piped: the kernel's plain source alone on stdout, the record and verdict on stderr.
    assert out == kernel, out
    assert "completed" in err and "interpreter" in err


async def test_submit_wait_times_out_with_exit_4(gateway: str, cpu_worker: None,
                                                 task_file: Path) -> None:
    code, _, err = await aikg("submit", str(task_file), "--wait", "--timeout", "0.5",
                              "--gateway", gateway)
    assert code == 4
    assert "aikg status" in err


async def test_submit_to_missing_backend_is_exit_2_listing_live(
    gateway: str, cpu_worker: None, task_file: Path
) -> None:
    code, _, err = await aikg("submit", str(task_file), "--backend", "cuda", "--gateway", gateway)
    assert code == 2
    assert "409" in err and "cpu/x86_64" in err


async def test_bad_file_is_exit_2(tmp_path: Path) -> None:
    code, _, err = await aikg("submit", str(tmp_path / "missing.py"))
    assert code == 2
    assert "missing.py" in err


async def test_bad_shape_is_exit_2(task_file: Path) -> None:
    code, _, err = await aikg("submit", str(task_file), "--shape", "batch_size")
    assert code == 2
    assert "NAME=VALUE" in err


async def test_unreachable_gateway_is_exit_3(task_file: Path, free_port) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    code, _, err = await aikg("submit", str(task_file), "--gateway", url)
    assert code == 3
    assert "cannot reach the gateway" in err
    code, _, _ = await aikg("status", "job-x", "--gateway", url)
    assert code == 3


async def test_status_unknown_job_is_exit_2(gateway: str) -> None:
    code, _, err = await aikg("status", "job-nope", "--gateway", gateway)
    assert code == 2
    assert "job-nope" in err


async def test_service_command_without_nats_url_is_exit_2(settings: Settings) -> None:
    code, _, err = await aikg("gateway", "--port", str(settings.gateway_port))
    assert code == 2
    assert "AIKG_NATS_URL" in err


async def _keys(bus: Bus) -> list[str]:
    try:
        return await bus.jobs.keys()
    except Exception:  # noqa: BLE001 - NoKeysError while the bucket is empty
        return []


async def _live_cpu(bus: Bus) -> bool:
    return (await live_arch(bus, "cpu", None))[0] is not None


def _cmdline(pid: int) -> list[str]:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    return []


async def _said(stream: asyncio.StreamReader, needle: bytes, timeout: float = 120) -> bytes:
    """The first line of ``stream`` holding ``needle``."""
    async def find() -> bytes:
        while needle not in (line := await stream.readline()):
            assert line, f"the stream ended before {needle!r}"
        return line

    return await asyncio.wait_for(find(), timeout)


@pytest.mark.slow
async def test_up_reports_a_service_that_dies(tmp_path: Path, free_port) -> None:
    """A gateway that cannot bind its port ends `aikg up` with exit 1, naming it; no strays."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        clean = {k: v for k, v in os.environ.items() if not k.startswith("AIKG_")}
        proc = await asyncio.create_subprocess_exec(
            *AIKG, "up", "--port", str(port), "--log-dir", str(tmp_path / "logs"),
            env={**clean, "COLUMNS": "200"}, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        family: set[int] = set()
        while proc.returncode is None:
            family |= descendants(proc.pid)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 0.2)
        _, err = await proc.communicate()
    assert proc.returncode == 1
    assert "gateway exited with code 1" in err.decode()
    assert str(tmp_path / "logs" / "gateway.log") in err.decode()
    assert "cannot listen" in (tmp_path / "logs" / "gateway.log").read_text()
    # The worker's fork server (its own session) exits when its control socket closes,
    # a moment after the worker.
    deadline = asyncio.get_running_loop().time() + scaled(30)
    while running(family) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.2)
    assert not running(family), f"still running: {sorted(running(family))}"


@pytest.mark.slow
async def test_up_killed_with_sigkill_leaves_no_strays(tmp_path: Path, free_port) -> None:
    """SIGKILL gives `aikg up` no chance to clean up: its children must go by themselves,
    and the next `aikg up` removes the run directory (credentials, temporary store) the
    killed one left, and its services a sandbox scratch root whose owner is gone (their
    fork servers removed their own roots). That next one runs with AIKG_TENANTS_FILE and
    no AIKG_API_TOKEN: the API wants a tenant's token the supervisor does not have, and
    it still sees the worker (through the bus) and says up."""
    from services.common.tenants import hash_token

    port = free_port()
    clean = {k: v for k, v in os.environ.items() if not k.startswith("AIKG_")}
    # The services' default scratch roots (aikg-<name>-<pid>-<hex>) go here, not to /tmp.
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**clean, "COLUMNS": "200", "AIKG_UP_RUN_DIR": str(tmp_path / "run"),
           "AIKG_UP_METRICS_PORT": "-1", "TMPDIR": str(temp)}
    proc = await asyncio.create_subprocess_exec(
        *AIKG, "up", "--port", str(port), "--log-dir", str(tmp_path / "logs"),
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    line = await asyncio.wait_for(proc.stdout.readline(), 120)
    assert b"AIKG is up" in line, line
    said = await _said(proc.stderr, b"NATS admin credentials", 10)
    run_dir = Path(said.decode().split("(nats CLI): ")[1].split()[0]).parent
    assert run_dir.parent == tmp_path / "run" and (run_dir / "jetstream").is_dir()
    family = descendants(proc.pid)
    assert len(family) >= 4  # nats-server, gateway, generator, worker
    roots = sorted(temp.glob("aikg-*"))
    assert {p.name.split("-")[1] for p in roots} == {"worker", "generator"}, roots
    proc.kill()
    await proc.wait()
    deadline = asyncio.get_running_loop().time() + scaled(30)
    while running(family) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.2)
    assert not running(family), f"still running: {sorted(running(family))}"
    assert run_dir.exists()
    # Their fork servers removed the services' scratch roots. A root whose fork server
    # died too (an OOM kill of the whole group) is left: the next stack removes it.
    assert not any(p.exists() for p in roots), roots
    left = temp / f"aikg-worker-vm-{proc.pid}-{proc.pid}-0badf00d"
    (left / "runs").mkdir(parents=True)
    (left / OWNER_FILE).write_text(f"{proc.pid} 1\n")

    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[tenants.team_a]\ntoken_sha256 = "{hash_token("tok-a")}"\n')
    again = await asyncio.create_subprocess_exec(
        *AIKG, "up", "--port", str(port), "--log-dir", str(tmp_path / "logs"),
        env={**env, "AIKG_TENANTS_FILE": str(tenants)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        said = await _said(again.stderr, b"NATS admin credentials", 60)
        assert not run_dir.exists(), "the killed aikg up's run directory is still there"
        assert Path(said.decode().split("(nats CLI): ")[1].split()[0]).parent.exists()
        line = await asyncio.wait_for(again.stdout.readline(), 120)
        assert b"AIKG is up: gateway http://127.0.0.1:" in line and b"worker cpu/" in line, line
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            assert (await client.get("/api/v1/workers")).status_code == 401
            r = await client.get("/api/v1/workers", headers={"Authorization": "Bearer tok-a"})
            assert r.status_code == 200 and r.json()["workers"]
        # The new stack's sandboxes removed the root whose owner is gone.
        async def swept() -> bool:
            return not left.exists()

        await poll_until(swept, 30, f"the scratch root the killed stack left ({left})")
    finally:
        again.terminate()
        code = await asyncio.wait_for(again.wait(), 60)
    assert code == 0
    assert list((tmp_path / "run").iterdir()) == []
    assert list(temp.glob("aikg-*")) == []  # and the second stack removed its own


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_up_runs_the_stack_restarts_a_killed_worker_and_stops_without_strays(
        tmp_path: Path, free_port, relu_task: str) -> None:
    """`aikg up` with an embedded NATS: the ready line, per-run NATS credentials (the
    admin's in a 0600 file, no anonymous client), a heartbeating worker. SIGKILL of the
    worker: the stack stays up, the worker is started again, a job submitted after the
    kill completes, and the restart is counted in the supervisor's metrics; SIGTERM then
    stops everything (the restarted worker too), keeps the logs and removes the
    credentials.

    With --prometheus-targets (and an API token): the file lists the gateway, the
    supervisor, the generator and the worker, each answering /metrics (the gateway
    with the token), the worker on the same port after its restart; deploy's local
    Prometheus configuration scrapes them all (when a prometheus binary is here); the
    file is gone at stop."""
    port, metrics_port = free_port(), free_port()
    token = "tok-up-metrics"
    auth = {"Authorization": f"Bearer {token}"}
    targets = tmp_path / "targets" / "aikg-up.json"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("AIKG_")}
    proc = await asyncio.create_subprocess_exec(
        *AIKG, "up", "--port", str(port), "--log-dir", str(tmp_path / "logs"),
        "--metrics-port", str(metrics_port), "--prometheus-targets", str(targets),
        env={**clean, "COLUMNS": "200", "AIKG_UP_RUN_DIR": str(tmp_path / "run"),
             "AIKG_API_TOKEN": token},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    family: set[int] = set()
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 180)
        assert b"AIKG is up: gateway http://127.0.0.1:" in line, line
        assert b"worker cpu/" in line
        family = descendants(proc.pid)
        assert len(family) >= 4  # nats-server, gateway, generator, worker
        code, out, err = await aikg("status", "job-none", "--gateway", f"http://127.0.0.1:{port}",
                                    env={"AIKG_API_TOKEN": token})
        assert code == 2, err
        # The embedded NATS takes per-run credentials only; the admin's are in a 0600 file.
        said = await _said(proc.stderr, b"NATS admin credentials", 10)
        admin_env = Path(said.decode().split("(nats CLI): ")[1].split()[0])
        assert admin_env.stat().st_mode & 0o777 == 0o600
        said = await _said(proc.stderr, b"Prometheus targets (file_sd): ", 10)
        assert str(targets).encode() in said, said
        endpoints = {group["labels"]["service"]: group["targets"]
                     for group in json.loads(targets.read_text())}
        assert set(endpoints) == {"gateway", "supervisor", "generator", "worker"}, endpoints
        assert endpoints["gateway"] == [f"127.0.0.1:{port}"]
        assert endpoints["supervisor"] == [f"127.0.0.1:{metrics_port}"]
        own_metric = {"gateway": "aikg_gateway_requests_total",
                      "supervisor": "aikg_service_restarts_total",
                      "generator": "aikg_generator_", "worker": "aikg_worker_devices"}
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"http://127.0.0.1:{port}/metrics")).status_code == 401
            for service, (where,) in endpoints.items():
                answer = await client.get(f"http://{where}/metrics", headers=auth)
                assert answer.status_code == 200, (service, answer.status_code)
                assert own_metric[service] in answer.text, service
        env = dict(ln.split("=", 1) for ln in admin_env.read_text().splitlines())
        assert env["NATS_USER"] == "admin"
        # AIKG's names too: a worker-only client sources the file as it is.
        assert load_settings(env=env).nats_user == "admin"
        anonymous = load_settings(env={}, nats_url=env["NATS_URL"])
        with pytest.raises(ConnectionError, match="refused this client's credentials"):
            await connect_bus(anonymous, "anonymous")
        admin = await connect_bus(load_settings(env={}, nats_url=env["NATS_URL"],
                                                nats_user=env["NATS_USER"],
                                                nats_password=env["NATS_PASSWORD"]), "admin")
        # The worker, connected as itself, beats. One read of the workers bucket can miss
        # a live key (nats-py's KeyValue.keys() raced a heartbeat put once here), so the
        # services' own look-again (live_arch) reads it.
        arch, _ = await live_arch(admin, "cpu", None)
        assert arch is not None, "no cpu worker heartbeat in the workers bucket"

        (worker,) = [p for p in family
                     if _cmdline(p)[1:4] == ["-m", "services.cli", "worker"]]
        os.kill(worker, signal.SIGKILL)
        said = await _said(proc.stderr, b"worker exited with code -9", 30)
        assert b"worker.log" in said and b"restarting it in" in said, said
        await _said(proc.stderr, b"worker restarted", 30)
        # "restarted" is the new process; it is live once it beats (its sandbox starts
        # first: seconds of CPU, more on a loaded machine). Until then the gateway
        # refuses a cpu job with 409, as it would for any user.
        await poll_until(lambda: _live_cpu(admin), 120, "the restarted worker's heartbeat")
        await admin.close()

        task = tmp_path / "relu.py"
        task.write_text(relu_task)
        code, out, err = await aikg("submit", str(task), "--wait", "--timeout", "400",
                                    "--gateway", f"http://127.0.0.1:{port}", timeout=scaled(450),
                                    env={"AIKG_API_TOKEN": token})
        assert code == 0, out + err
        assert proc.returncode is None, "aikg up stopped"
        async with httpx.AsyncClient() as client:
            text = (await client.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
            # The restarted worker serves /metrics where the targets file says.
            (worker_metrics,) = endpoints["worker"]
            again = await client.get(f"http://{worker_metrics}/metrics")
        assert 'aikg_service_restarts_total{service="worker"} 1.0' in text, text
        assert 'aikg_worker_verifications_total{' in again.text, again.text
        if prometheus_binary() is not None:
            health = await scraped_health(targets.parent, token, tmp_path / "prometheus",
                                          set(endpoints), scaled(60))
            assert health == dict.fromkeys(endpoints, "up"), health
        family |= descendants(proc.pid)
    finally:
        if proc.returncode is None:
            proc.terminate()
        code = await asyncio.wait_for(proc.wait(), 60)
    stderr = (await proc.stderr.read()).decode()
    assert code == 0, stderr
    deadline = asyncio.get_running_loop().time() + scaled(30)
    while running(family) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.2)
    assert not running(family), f"still running: {sorted(running(family))}"
    assert f"service logs kept in {tmp_path / 'logs'}" in stderr
    assert {"gateway.log", "generator.log", "worker.log"} <= {
        p.name for p in (tmp_path / "logs").iterdir()}
    assert not admin_env.exists(), "the per-run credentials outlived aikg up"
    assert not targets.exists(), "the Prometheus targets outlived aikg up"


@pytest.mark.slow
async def test_demo_is_the_main_job_end_to_end() -> None:
    """`make run` = `aikg demo tasks/relu.py`: a throw-away stack, a passed verdict, the
    kernel (piped: its plain source alone on stdout), no NATS credentials of a stack
    that is gone, and nothing left behind when the job passed."""
    code, out, err = await aikg("demo", "tasks/relu.py", timeout=scaled(600))
    assert code == 0, out + err
    assert "completed" in err and "passed" in err
    assert "@triton.jit" in out and "class ModelNew" in out and "│" not in out
    assert "NATS admin credentials" not in err and "nats-admin.env" not in err
    log_dir = Path(next(line for line in err.splitlines() if line.startswith("logs: "))[6:])
    assert "logs removed: the job passed" in err
    assert not log_dir.exists()
