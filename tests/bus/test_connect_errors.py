"""A connection that fails says so in one line: refused credentials name the settings to
set and where ``aikg up`` writes them, with no nats-py traceback per retry; an
unreachable server names its last error, never an empty reason.

The server is the ``nats_server`` fixture (the users of ``aikg up``,
services/common/nats_auth.py). The worker-only client runs as a user's script would, in
a child process whose stdout and stderr are read whole.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from services.common.bus import NatsAuthError, connect_bus, open_nats
from services.common.nats_auth import BusCredentials
from services.common.settings import Settings, load_settings
from tests.helpers import scaled

ROOT = Path(__file__).resolve().parents[2]

# The README's worker-only snippet, cut to the connection: register, then verify.
SCRIPT = """
import asyncio, sys
from services.sdk import RemoteWorker, register_remote_worker

async def main():
    await register_remote_worker(backend="cpu", arch="x86_64")
    await RemoteWorker(backend="cpu", arch="x86_64").verify("x = 1", "y = 2", "relu")

if sys.argv[1] == "caught":
    try:
        asyncio.run(main())
    except ConnectionError as exc:
        print(exc, file=sys.stderr)
        sys.exit(1)
else:
    asyncio.run(main())
"""


def run_script(how: str, env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], float]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("AIKG_")}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", SCRIPT, how], cwd=ROOT, text=True,
                          capture_output=True, env={**clean, **env}, timeout=scaled(60))
    return done, time.monotonic() - started


def test_a_refused_worker_only_client_says_one_line_naming_the_credentials(
        settings: Settings, tmp_path: Path) -> None:
    """The README's snippet with a user the server does not know: one line on stderr,
    at once, naming the user, AIKG_NATS_USER/AIKG_NATS_PASSWORD and the nats-admin.env
    of the aikg up it finds; no nats-py traceback, no empty reason."""
    run_dir = tmp_path / "runs" / "aikg-up-4242-abcd"
    run_dir.mkdir(parents=True)
    BusCredentials().write_admin_env(run_dir / "nats-admin.env", settings.nats_url)
    env = {"AIKG_NATS_URL": settings.nats_url, "AIKG_NATS_USER": "generator",
           "AIKG_NATS_PASSWORD": "not-the-password", "AIKG_UP_RUN_DIR": str(tmp_path / "runs")}
    done, took = run_script("caught", env)
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"cannot connect to NATS at {settings.nats_url}: authorization "
                           "violation: user 'generator' is not allowed"), line
    assert "AIKG_NATS_USER/AIKG_NATS_PASSWORD" in line
    assert f"aikg up writes them to {run_dir / 'nats-admin.env'}" in line, line
    # Refused at once: the first refusal ends the tries (the connect deadline is 10 s).
    assert took < scaled(8), took

    # Uncaught, Python prints the script's own traceback once, ending in that line.
    done, _ = run_script("uncaught", {**env, "AIKG_NATS_USER": "", "AIKG_NATS_PASSWORD": ""})
    assert done.returncode == 1
    assert done.stderr.count("Traceback") == 1, done.stderr
    assert "nats: encountered error" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "authorization violation: a client without credentials is not allowed" in last
    assert "/aikg-up-4242-abcd/nats-admin.env" in last, last


async def test_a_refused_service_raises_one_line_and_logs_no_traceback(
        settings: Settings, caplog: pytest.LogCaptureFixture) -> None:
    """connect_bus as a service with a wrong password: NatsAuthError (a ConnectionError)
    in one line naming the service's own variables; nothing logged with a traceback."""
    wrong = msgspec.structs.replace(settings, nats_generator_password="nope")
    caplog.set_level(logging.DEBUG)
    with pytest.raises(NatsAuthError) as err:
        await connect_bus(wrong, "wrong", role="generator")
    message = str(err.value)
    assert "\n" not in message
    assert "user 'generator' is not allowed" in message
    assert "AIKG_NATS_GENERATOR_USER/_PASSWORD or AIKG_NATS_USER/AIKG_NATS_PASSWORD" in message
    assert "nats-admin.env" in message
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]


async def test_an_unreachable_server_names_its_last_error() -> None:
    """A port where nothing listens, and one that accepts but never speaks NATS: the
    message names the URL and a reason, never an empty one."""
    settings = load_settings(env={})
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with pytest.raises(ConnectionError) as err:
        await open_nats(f"nats://127.0.0.1:{port}", "t", {}, settings=settings, timeout_s=1.0)
    assert not isinstance(err.value, NatsAuthError)
    reason = str(err.value).split("(tried for 1 s): ", 1)[1]
    assert reason.strip(), str(err.value)

    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        url = f"nats://127.0.0.1:{mute.getsockname()[1]}"
        with pytest.raises(ConnectionError) as err:
            await open_nats(url, "t", {}, settings=settings, timeout_s=1.5)
    assert str(err.value).startswith(f"cannot reach NATS at {url} (tried for 1.5 s): ")
    assert str(err.value).split("): ", 1)[1].strip(), str(err.value)


def test_nats_admin_env_gives_aikg_settings_and_the_nats_cli_names(tmp_path: Path) -> None:
    """The file aikg up writes, sourced by a shell: AIKG's settings read the admin's URL,
    user and password from it, and the nats CLI's NATS_* names are there too."""
    credentials = BusCredentials()
    path = credentials.write_admin_env(tmp_path / "nats-admin.env", "nats://127.0.0.1:4999")
    assert path.stat().st_mode & 0o777 == 0o600
    show = ("from services.common.settings import load_settings; s = load_settings(); "
            "import os; print(s.nats_url, s.nats_user, s.nats_password, os.environ['NATS_USER'])")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("AIKG_", "NATS_"))}
    done = subprocess.run(["bash", "-c", f'set -a; . "{path}"; set +a; '
                           f'"{sys.executable}" -c "{show}"'], cwd=ROOT, env=clean,
                          capture_output=True, text=True, timeout=scaled(60))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["nats://127.0.0.1:4999", "admin",
                                   credentials.passwords["admin"], "admin"]


async def test_the_sdk_connects_with_the_sourced_admin_env(settings: Settings,
                                                            bus_credentials: BusCredentials,
                                                            tmp_path: Path) -> None:
    """The admin's AIKG_* lines of nats-admin.env are credentials the server takes."""
    path = bus_credentials.write_admin_env(tmp_path / "nats-admin.env", settings.nats_url)
    env = dict(line.split("=", 1) for line in path.read_text().splitlines())
    from services.sdk import RemoteWorker

    worker = RemoteWorker(backend="cpu", settings=load_settings(env=env))
    try:
        assert await asyncio.wait_for(worker.live_workers(), scaled(10)) == []
    finally:
        await worker.close()
