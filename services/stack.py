"""The local stack supervisor behind ``aikg up``, ``aikg demo`` and ``bench/``: NATS
(embedded unless configured), gateway, generator and one worker as child processes of
this one, started, watched and stopped together (:func:`local_stack`).

It raises :class:`StackError` rather than exiting, so a caller decides what a stack
that did not come up means (the CLI: exit 1; ``bench/gpu_check.py``: a failed check).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec

from services.common.settings import Settings


class StackError(RuntimeError):
    """The local stack did not come up, or one of its services died; the message says
    which service and where its log is."""


def _say(message: str) -> None:
    """Default reporter of :func:`local_stack`: one plain line on stderr."""
    print(message, file=sys.stderr, flush=True)


def stop_children(children: dict[str, subprocess.Popen[bytes]], grace_s: float = 10.0) -> None:
    """SIGTERM each child's process group, wait up to ``grace_s``, then SIGKILL what is left."""
    for proc in children.values():
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in children.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.0, deadline - time.monotonic()))
    for proc in children.values():
        # The group may outlive its leader (a sandboxed candidate): kill it in any case.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@dataclasses.dataclass
class LocalStack:
    """What :func:`local_stack` started: URLs, the live worker list, the children."""

    gateway_url: str
    nats_url: str
    workers: list[dict[str, Any]]
    children: dict[str, subprocess.Popen[bytes]]
    logs: dict[str, Path]
    # The embedded server's admin credentials (NATS_URL/NATS_USER/NATS_PASSWORD, 0600).
    admin_env: Path | None = None

    def dead_child(self) -> str | None:
        """``"<service> exited with code N; log: PATH"`` for the first dead child, else None."""
        for name, proc in self.children.items():
            if proc.poll() is not None:
                where = f"; log: {self.logs[name]}" if name in self.logs else ""
                return f"{name} exited with code {proc.returncode}{where}{self._cause(name)}"
        return None

    def _cause(self, name: str) -> str:
        """The last error the service logged (e.g. the port in use), for the message."""
        path = self.logs.get(name)
        if path is None:
            return ""
        with contextlib.suppress(OSError):
            lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
            if lines:
                return f"\n  {lines[-1][:500]}"
        return ""

    def describe(self) -> str:
        """``"gateway URL, NATS URL, worker backend/arch (N devices)"``, for a ready line."""
        if not self.workers:
            return f"gateway {self.gateway_url}, NATS {self.nats_url}"
        w = self.workers[0]
        n = len(w.get("devices", []))
        return (f"gateway {self.gateway_url}, NATS {self.nats_url}, worker "
                f"{w['backend']}/{w['arch']} ({n} device{'s' if n != 1 else ''})")


@contextlib.contextmanager
def local_stack(
    settings: Settings, *, host: str, port: int, backend: str, arch: str | None, devices: str,
    store_dir: Path | None, log_dir: Path | None, verbose: bool, ready_timeout: float,
    stopping: threading.Event | None = None, nats_auth: bool = True,
    say: Callable[[str], None] = _say,
) -> Iterator[LocalStack]:
    """Start NATS (embedded unless ``settings.nats_url``), gateway, generator and a worker
    as child processes, each in its own process group; wait until the gateway is ready
    and lists a worker of ``backend``; on exit stop them all (no stray processes).

    With ``nats_auth`` the embedded server gets per-run random passwords for an admin
    and each service, with each service's permissions (services/common/nats_auth.py),
    in a configuration file in a private (0700) temporary directory removed at exit;
    each service gets only its own user (the worker ``worker-<its id>``), and
    ``aikg nats-setup --serve`` runs beside them as the admin, making the durable
    consumers the services may only bind (services/common/provision.py). An external
    server (``settings.nats_url``) is left as configured: the services read their
    ``AIKG_NATS_*`` credentials, and its operator runs ``aikg nats-setup``.

    ``stopping`` set (a signal handler's doing) ends the wait for readiness early;
    ``say`` reports where the logs and the admin credentials are, and the stop.

    Raises:
        StackError: NATS cannot start, a service dies, or the stack is not up within
            ``ready_timeout`` s (gateway ready and a ``backend`` worker listed).
    """
    stopping = stopping or threading.Event()
    from services.common.embedded import EmbeddedNatsServer, die_with_parent
    from services.common.nats_auth import BusCredentials

    nats: EmbeddedNatsServer | None = None
    children: dict[str, subprocess.Popen[bytes]] = {}
    logs: dict[str, Path] = {}
    credentials: BusCredentials | None = None
    auth_dir: Path | None = None
    admin_env: Path | None = None
    try:
        nats_url = settings.nats_url
        if not nats_url:
            config = None
            if nats_auth:
                from services.worker.service import default_worker_id

                # The worker's own NATS user may write only this id's heartbeat and leases.
                credentials = BusCredentials(
                    worker_ids=(settings.worker_id or default_worker_id(),))
                auth_dir = Path(tempfile.mkdtemp(prefix="aikg-nats-auth-"))
                config = credentials.write_server_config(auth_dir / "nats-server.conf")
            nats = EmbeddedNatsServer(store_dir, die_with_parent=True, config_file=config)
            try:
                nats_url = nats.start()
            except (RuntimeError, FileNotFoundError) as exc:
                raise StackError(str(exc)) from exc
            if credentials is not None and auth_dir is not None:
                admin_env = credentials.write_admin_env(auth_dir / "nats-admin.env", nats_url)
                say(f"NATS admin credentials (nats CLI): {admin_env} "
                    f"(`set -a; . {admin_env}; set +a`)")
        if not verbose:
            log_dir = log_dir or Path(tempfile.mkdtemp(prefix="aikg-logs-"))
            log_dir.mkdir(parents=True, exist_ok=True)
            say(f"logs: {log_dir}")
        gateway_url = f"http://{host}:{port}"
        env = {**os.environ, "AIKG_NATS_URL": nats_url, "AIKG_GATEWAY_URL": gateway_url,
               "PYTHONUNBUFFERED": "1"}
        if nats is not None:
            # The embedded server knows only its own users: credentials meant for
            # another server would be refused (or contradict the per-run ones).
            env = {k: v for k, v in env.items()
                   if not k.startswith("AIKG_NATS_") or k in ("AIKG_NATS_URL",
                                                              "AIKG_NATS_STORE_DIR")}
        commands = {
            # As the admin: makes the JOBS/VERIFY consumers no service may create.
            **({"nats-setup": ["nats-setup", "--serve"]} if credentials is not None else {}),
            "gateway": ["gateway", "--host", host, "--port", str(port)],
            "generator": ["generator"],
            "worker": ["worker", "--backend", backend, "--devices", devices,
                       *(["--arch", arch] if arch else [])],
        }
        for name, args in commands.items():
            stream: Any = None
            if log_dir is not None and not verbose:
                logs[name] = log_dir / f"{name}.log"
                stream = logs[name].open("ab")
            try:
                own = credentials.service_env(
                    "admin" if name == "nats-setup" else name) if credentials is not None else {}
                children[name] = subprocess.Popen(
                    [sys.executable, "-m", "services.cli", *args],
                    env={**env, **own}, stdout=stream, stderr=stream, stdin=subprocess.DEVNULL,
                    start_new_session=True, preexec_fn=die_with_parent,
                )
            finally:
                if stream is not None:
                    stream.close()
        stack = LocalStack(gateway_url=gateway_url, nats_url=nats_url, workers=[],
                           children=children, logs=logs, admin_env=admin_env)
        headers = {"Authorization": f"Bearer {settings.api_token}"} if settings.api_token else {}
        deadline = time.monotonic() + ready_timeout
        with httpx.Client(base_url=gateway_url, timeout=2.0, headers=headers) as client:
            while not stopping.is_set():
                if (dead := stack.dead_child()) is not None:
                    raise StackError(f"AIKG did not come up: {dead}")
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    if client.get("/readyz").status_code == 200:
                        answer = client.get("/api/v1/workers")
                        if answer.status_code in (401, 403):
                            # The API takes only tenant tokens (AIKG_TENANTS_FILE) and this
                            # supervisor holds none: it asks the workers bucket itself.
                            user, password = _admin_login(settings, credentials)
                            listed = workers_over_nats(nats_url, user, password)
                        else:
                            listed = answer.json().get("workers", [])
                        stack.workers = [w for w in listed if w.get("backend") == backend]
                        if stack.workers:
                            break
                if time.monotonic() > deadline:
                    raise StackError(f"AIKG did not come up in {ready_timeout:.0f} s "
                                     f"(gateway ready and a {backend} worker listed); see "
                                     "the logs" + (f" in {log_dir}" if logs else ""))
                stopping.wait(0.25)
        yield stack
    finally:
        if children:
            say("stopping services ...")
        stop_children(children)
        if nats is not None:
            nats.stop()
        if auth_dir is not None:
            shutil.rmtree(auth_dir, ignore_errors=True)


def _admin_login(settings: Settings, credentials: Any) -> tuple[str | None, str | None]:
    """The NATS user and password this supervisor reads the bus with: the per-run
    admin's when it started the server, else the configured plain ones."""
    if credentials is not None:
        from services.common.nats_auth import ADMIN_USER

        return ADMIN_USER, credentials.passwords[ADMIN_USER]
    return settings.nats_user or None, settings.nats_password or None


def workers_over_nats(nats_url: str, user: str | None, password: str | None,
                      timeout_s: float = 2.0) -> list[dict[str, Any]]:
    """The live workers' heartbeats (``WorkerInfo`` as dicts) read from the ``workers``
    bucket; empty when NATS or the bucket cannot be read within ``timeout_s`` seconds."""
    import asyncio

    import nats

    from services.common.jobs import heartbeats

    async def read() -> list[dict[str, Any]]:
        nc = await nats.connect(nats_url, user=user, password=password,
                                connect_timeout=timeout_s, allow_reconnect=False)
        try:
            js = nc.jetstream(timeout=timeout_s)
            return [msgspec.to_builtins(info) for info in await heartbeats(js)]
        finally:
            await nc.close()

    try:
        return asyncio.run(asyncio.wait_for(read(), timeout_s * 3))
    except Exception:  # noqa: BLE001 - not ready yet: the caller polls again
        return []
