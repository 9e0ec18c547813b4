"""The local stack's supervisor and run directories (services/stack.py) over real
processes: a child that dies is started again after a backoff and counted; one that
keeps dying stops being restarted; a dead ``aikg up``'s run directory goes, a live
one's stays; the embedded NATS server comes back on its port and store."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nats
import pytest

from services.common.embedded import EmbeddedNatsServer
from services.common.runtime import OWNER_FILE
from services.stack import RUN_DIR_PREFIX, claim_run_dir, remove_stale_run_dirs
from services.supervisor import SUPERVISOR_REGISTRY, Supervisor
from tests.helpers import scaled


def sleeper() -> subprocess.Popen[bytes]:
    """A real child in its own process group that lives until killed."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                            start_new_session=True)


def restarts_counted(service: str) -> float:
    return SUPERVISOR_REGISTRY.get_sample_value("aikg_service_restarts_total",
                                                {"service": service}) or 0.0


def wait_until(check, timeout_s: float = 30.0, every_s: float = 0.05):
    deadline = time.monotonic() + scaled(timeout_s)
    while not (value := check()):
        assert time.monotonic() < deadline, "not within the time allowed"
        time.sleep(every_s)
    return value


def test_supervisor_restarts_with_backoff_then_gives_up(tmp_path: Path) -> None:
    log = tmp_path / "svc.log"
    log.write_text("first line\nlast words of the service\n")
    started: list[subprocess.Popen[bytes]] = []
    said: list[str] = []

    def spawn(_name: str) -> subprocess.Popen[bytes]:
        started.append(sleeper())
        return started[-1]

    first = spawn("svc")
    before = restarts_counted("svc")
    supervisor = Supervisor({"svc": first}, spawn, logs={"svc": log}, restart_max=2,
                            window_s=300.0, backoff_max_s=0.75, say=said.append,
                            poll_s=0.05)
    assert [supervisor.backoff_s(n) for n in (1, 2, 3, 4)] == [0.5, 0.75, 0.75, 0.75]
    supervisor.start()
    try:
        for restart_no in (1, 2):
            victim = started[-1]
            os.kill(victim.pid, signal.SIGKILL)
            killed = time.monotonic()
            wait_until(lambda n=restart_no: len(started) == n + 1)
            # The first restart waits 0.5 s, the next the cap (0.75 s).
            assert time.monotonic() - killed >= 0.45
            assert started[-1].poll() is None
            assert restarts_counted("svc") == before + restart_no
        assert any("svc exited with code -9" in s and str(log) in s and "restart 1 of at most 2"
                   in s for s in said), said
        os.kill(started[-1].pid, signal.SIGKILL)
        failure = wait_until(lambda: supervisor.failure)
        assert failure.startswith("svc exited with code -9 after 2 restarts in 300 s")
        assert str(log) in failure and "last words of the service" in failure
        time.sleep(1.0)
        assert len(started) == 3, "restarted after giving up"
    finally:
        supervisor.join()
        for proc in started:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def test_supervisor_restarts_nothing_once_closed(tmp_path: Path) -> None:
    started: list[subprocess.Popen[bytes]] = []

    def spawn(_name: str) -> subprocess.Popen[bytes]:
        started.append(sleeper())
        return started[-1]

    supervisor = Supervisor({"svc": spawn("svc")}, spawn, logs={}, restart_max=5,
                            window_s=60.0, backoff_max_s=0.1, poll_s=0.05, say=lambda _: None)
    supervisor.start()
    supervisor.close()
    started[0].kill()
    started[0].wait()
    time.sleep(0.5)
    supervisor.join()
    assert len(started) == 1


def test_stale_run_dirs_go_and_live_ones_stay(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"{RUN_DIR_PREFIX}{dead.pid}-abc"
    (stale / "jetstream").mkdir(parents=True)
    (stale / "nats-admin.env").write_text("NATS_PASSWORD=x\n")
    live = tmp_path / f"{RUN_DIR_PREFIX}{os.getppid()}-def"
    live.mkdir()
    # A live pid whose start time is not the owner's: the pid was reused.
    reused = tmp_path / f"{RUN_DIR_PREFIX}{os.getppid()}-ghi"
    reused.mkdir()
    (reused / OWNER_FILE).write_text(f"{os.getppid()} 1\n")
    unrelated = tmp_path / f"{RUN_DIR_PREFIX}notapid-x"
    unrelated.mkdir()

    mine, removed = claim_run_dir(tmp_path)
    assert sorted(removed) == sorted([stale, reused])
    assert not stale.exists() and not reused.exists()
    assert live.exists() and unrelated.exists()
    assert mine.name.startswith(f"{RUN_DIR_PREFIX}{os.getpid()}-")
    assert mine.stat().st_mode & 0o777 == 0o700
    # This process's own directory is kept by the next start.
    assert remove_stale_run_dirs(tmp_path) == []
    assert mine.exists()


@pytest.mark.timeout(120)
async def test_embedded_nats_restarts_on_its_port_and_store(tmp_path: Path) -> None:
    server = EmbeddedNatsServer(tmp_path / "store")
    url = server.start()
    try:
        nc = await nats.connect(url)
        js = nc.jetstream()
        await js.add_stream(name="KEEP", subjects=["keep.>"])
        await js.publish("keep.one", b"1")
        await nc.close()
        server.kill()
        assert server.restart() == url
        nc = await nats.connect(url)
        info = await nc.jetstream().stream_info("KEEP")
        assert info.state.messages == 1
        await nc.close()
    finally:
        server.stop()
