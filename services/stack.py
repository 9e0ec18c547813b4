"""The local stack supervisor behind ``aikg up``, ``aikg demo`` and ``bench/``: NATS
(embedded unless configured), gateway, generator and one worker as child processes of
this one, started, watched and stopped together (:func:`local_stack`).

Once the stack is up, a :class:`~services.supervisor.Supervisor` thread restarts a service that dies (the
embedded NATS server on its port and store, so the others reconnect), after a wait
that doubles with each restart of that service (tenacity's exponential wait, capped
at ``up_restart_backoff_max_s``); each restart is said and counted in
``aikg_service_restarts_total{service}``. Only a service that dies more than
``up_restart_max`` times within ``up_restart_window_s`` ends the stack, named with its
log. A service that dies before the stack is up ends it at once (a port in use, a
bad setting: restarting would not help).

Per-run files (the embedded server's credentials and configuration, a temporary
JetStream store) live in ``<up_run_dir or the temp dir>/aikg-up-<pid>-*``, removed at
exit; a start removes the directories of ``aikg up`` processes that are gone (killed
with SIGKILL, which leaves no chance to clean up).

For Prometheus, :func:`metrics_ports` gives the generator and the worker fixed
``/metrics`` ports (a base, or free ports picked at start), :attr:`LocalStack.metrics`
lists the endpoints, and :func:`write_prometheus_targets` writes them as a file_sd
target list (``aikg up --metrics-port-base`` / ``--prometheus-targets``;
docs/operations.md, "Prometheus and Grafana for aikg up").

It raises :class:`StackError` rather than exiting, so a caller decides what a stack
that did not come up means (the CLI: exit 1; ``bench/gpu_check.py``: a failed check).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import msgspec

from services.common.embedded import UP_RUN_DIR_PREFIX, up_run_dir_base
from services.common.runtime import claim_owner, free_port, remove_stale_dirs
from services.common.settings import Settings
from services.supervisor import Supervisor, log_hint, say_line, stop_children

if TYPE_CHECKING:
    from services.common.embedded import EmbeddedNatsServer
    from services.common.nats_auth import BusCredentials

# Name prefix of a per-run directory: aikg-up-<pid of aikg up>-<random>.
RUN_DIR_PREFIX = UP_RUN_DIR_PREFIX


class StackError(RuntimeError):
    """The local stack did not come up, or one of its services died; the message says
    which service and where its log is."""


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
    # Restarts the services that die once the stack is up (None: nobody does).
    supervisor: Supervisor | None = None
    # This run's directory (credentials, temporary store), removed at exit.
    run_dir: Path | None = None
    # Service -> HOST:PORT of its /metrics where known: the gateway (its HTTP port),
    # and the generator and worker when given fixed ports (metrics_ports).
    metrics: dict[str, str] = dataclasses.field(default_factory=dict)

    def dead_child(self) -> str | None:
        """Why the stack cannot go on, else None: with a supervisor, the service that
        died too often (``"worker exited with code -9 after 5 restarts in 300 s; log:
        PATH"``); without one, ``"<service> exited with code N; log: PATH"`` for the
        first dead child."""
        if self.supervisor is not None:
            return self.supervisor.failure
        for name, proc in self.children.items():
            if proc.poll() is not None:
                return f"{name} exited with code {proc.returncode}{log_hint(self.logs, name)}"
        return None

    def describe(self) -> str:
        """``"gateway URL, NATS URL, worker backend/arch (N devices)"``, for a ready line."""
        if not self.workers:
            return f"gateway {self.gateway_url}, NATS {self.nats_url}"
        w = self.workers[0]
        n = len(w.get("devices", []))
        return (f"gateway {self.gateway_url}, NATS {self.nats_url}, worker "
                f"{w['backend']}/{w['arch']} ({n} device{'s' if n != 1 else ''})")


def remove_stale_run_dirs(base: Path) -> list[Path]:
    """Remove this user's ``aikg-up-<pid>-*`` directories under ``base`` whose ``aikg up``
    (the pid, started when its owner file says) no longer runs
    (:func:`~services.common.runtime.remove_stale_dirs`).

    Returns:
        The directories removed.
    """
    def pid_of(name: str) -> int | None:
        part = name[len(RUN_DIR_PREFIX):].split("-", 1)[0]
        return int(part) if part.isdigit() else None

    return remove_stale_dirs(base, f"{RUN_DIR_PREFIX}*-*", pid_of)


def claim_run_dir(base: Path) -> tuple[Path, list[Path]]:
    """A new private (0700) run directory under ``base`` owned by this process, after
    removing stale ones (:func:`remove_stale_run_dirs`).

    Returns:
        The new directory and the stale ones removed.

    Raises:
        OSError: ``base`` cannot be created or written.
    """
    base.mkdir(parents=True, exist_ok=True)
    removed = remove_stale_run_dirs(base)
    path = Path(tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-", dir=base))
    claim_owner(path)
    return path, removed


def run_dir_base(settings: Settings) -> Path:
    """Where run directories go: ``up_run_dir``, else the system temp dir."""
    return up_run_dir_base(settings.up_run_dir)


@contextlib.contextmanager
def local_stack(
    settings: Settings, *, host: str, port: int, backend: str, arch: str | None, devices: str,
    store_dir: Path | None, log_dir: Path | None, verbose: bool, ready_timeout: float,
    stopping: threading.Event | None = None, nats_auth: bool = True,
    say: Callable[[str], None] = say_line, supervise: bool = True,
    metrics_ports: dict[str, int] | None = None,
) -> Iterator[LocalStack]:
    """Start NATS (embedded unless ``settings.nats_url``), gateway, generator and a worker
    as child processes, each in its own process group; wait until the gateway is ready
    and lists a worker of ``backend``; on exit stop them all (no stray processes).

    With ``supervise`` (the default), once the stack is up a :class:`Supervisor`
    restarts what dies (settings ``up_restart_max``, ``up_restart_window_s``,
    ``up_restart_backoff_max_s``); :meth:`LocalStack.dead_child` then says when a
    service died too often and the caller should stop.

    With ``nats_auth`` the embedded server gets per-run random passwords for an admin
    and each service, with each service's permissions (services/common/nats_auth.py),
    in a configuration file in this run's private (0700) directory
    (:func:`claim_run_dir`), removed at exit; each service gets only its own user (the
    worker ``worker-<its id>``), and ``aikg nats-setup --serve`` runs beside them as the
    admin, making the durable consumers the services may only bind
    (services/common/provision.py). An external server (``settings.nats_url``) is left
    as configured: the services read their ``AIKG_NATS_*`` credentials, and its
    operator runs ``aikg nats-setup``. Without ``store_dir`` the embedded server's
    JetStream store is in the run directory too.

    ``stopping`` set (a signal handler's doing) ends the wait for readiness early;
    ``say`` reports where the logs and the admin credentials are, restarts, and the stop.

    ``metrics_ports`` (:func:`metrics_ports`) gives the generator and the worker their
    ``/metrics`` port on the command line (``--metrics-port``), kept across restarts,
    and lists them in :attr:`LocalStack.metrics`; without it they keep the inherited
    ``AIKG_METRICS_PORT`` (default 0: a free port each, not reported).

    The steps are :class:`_StackRun`'s: the embedded NATS, the log directory, the
    services' environment and commands, their start, the wait until the stack is up,
    the supervisor, and the stop.

    Raises:
        StackError: the run directory or NATS cannot be had, a service dies before the
            stack is up, or the stack is not up within ``ready_timeout`` s (gateway
            ready and a ``backend`` worker listed).
    """
    run = _StackRun(settings, say)
    try:
        nats_url = settings.nats_url or run.start_embedded_nats(store_dir, nats_auth)
        run.log_dir = None if verbose else _make_log_dir(log_dir, say)
        gateway_url = f"http://{host}:{port}"
        run.env = _service_env(nats_url, gateway_url, embedded=run.nats is not None)
        run.commands = _service_commands(host, port, backend, arch, devices,
                                         nats_setup=run.credentials is not None,
                                         metrics_ports=metrics_ports or {})
        for name in run.commands:
            run.start_service(name)
        stack = LocalStack(gateway_url=gateway_url, nats_url=nats_url, workers=[],
                           children=run.children, logs=run.logs, admin_env=run.admin_env,
                           run_dir=run.run_dir,
                           metrics=_metrics_endpoints(host, port, metrics_ports or {}))
        run.wait_until_up(stack, backend, ready_timeout, stopping or threading.Event())
        if supervise:
            stack.supervisor = run.supervise()
        yield stack
    finally:
        run.stop()


class _StackRun:
    """One :func:`local_stack` run in steps: what it started, and how to stop it all.

    ``children`` and ``logs`` are the very dicts the :class:`LocalStack` and the
    :class:`Supervisor` hold: a restart replaces a child in place.
    """

    def __init__(self, settings: Settings, say: Callable[[str], None]) -> None:
        self.settings = settings
        self.say = say
        self.nats: EmbeddedNatsServer | None = None
        self.credentials: BusCredentials | None = None
        self.run_dir: Path | None = None
        self.admin_env: Path | None = None
        self.log_dir: Path | None = None
        self.env: dict[str, str] = {}
        self.commands: dict[str, list[str]] = {}
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}
        self.supervisor: Supervisor | None = None

    def start_embedded_nats(self, store_dir: Path | None, nats_auth: bool) -> str:
        """Claim this run's directory, start the embedded nats-server (with per-run
        credentials when ``nats_auth``: the admin's written to ``nats-admin.env``), and
        return its URL.

        Raises:
            StackError: the run directory cannot be created, or the server not started.
        """
        from services.common.embedded import EmbeddedNatsServer
        from services.common.nats_auth import BusCredentials

        try:
            self.run_dir, stale = claim_run_dir(run_dir_base(self.settings))
        except OSError as exc:
            raise StackError(f"cannot create a run directory: {exc}") from exc
        for path in stale:
            self.say(f"removed {path}, left by an aikg up that is gone")
        config = None
        if nats_auth:
            from services.worker.service import default_worker_id

            # The worker's own NATS user may write only this id's heartbeat and leases.
            self.credentials = BusCredentials(
                worker_ids=(self.settings.worker_id or default_worker_id(),))
            config = self.credentials.write_server_config(self.run_dir / "nats-server.conf")
        self.nats = EmbeddedNatsServer(store_dir or self.run_dir / "jetstream",
                                       die_with_parent=True, config_file=config)
        try:
            nats_url = self.nats.start()
        except (RuntimeError, FileNotFoundError) as exc:
            raise StackError(str(exc)) from exc
        if self.credentials is not None:
            self.admin_env = self.credentials.write_admin_env(self.run_dir / "nats-admin.env",
                                                              nats_url)
            self.say(f"NATS admin credentials (nats CLI): {self.admin_env} "
                     f"(`set -a; . {self.admin_env}; set +a`)")
        return nats_url

    def start_service(self, name: str) -> subprocess.Popen[bytes]:
        """Start (or, for a restart, start again) the service ``name`` as ``python -m
        services.cli <command>`` in its own session, its output appended to its log;
        ``nats`` restarts the embedded server on its port and store."""
        from services.common.embedded import die_with_parent

        if name == "nats":
            assert self.nats is not None
            self.nats.restart()
            assert self.nats.proc is not None
            return self.nats.proc  # type: ignore[return-value]
        stream: Any = None
        if self.log_dir is not None:
            self.logs[name] = self.log_dir / f"{name}.log"
            stream = self.logs[name].open("ab")
        try:
            own = self.credentials.service_env(
                "admin" if name == "nats-setup" else name) if self.credentials is not None else {}
            self.children[name] = subprocess.Popen(
                [sys.executable, "-m", "services.cli", *self.commands[name]],
                env={**self.env, **own}, stdout=stream, stderr=stream,
                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent,
            )
        finally:
            if stream is not None:
                stream.close()
        return self.children[name]

    def wait_until_up(self, stack: LocalStack, backend: str, ready_timeout: float,
                      stopping: threading.Event) -> None:
        """Poll until the gateway is ready and lists a ``backend`` worker (set in
        ``stack.workers``), or ``stopping`` is set.

        Raises:
            StackError: a service died first, or ``ready_timeout`` seconds passed.
        """
        settings = self.settings
        headers = {"Authorization": f"Bearer {settings.api_token}"} if settings.api_token else {}
        deadline = time.monotonic() + ready_timeout
        with httpx.Client(base_url=stack.gateway_url, timeout=2.0, headers=headers) as client:
            while not stopping.is_set():
                if (dead := stack.dead_child()) is not None:
                    raise StackError(f"AIKG did not come up: {dead}")
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    if client.get("/readyz").status_code == 200:
                        answer = client.get("/api/v1/workers")
                        if answer.status_code in (401, 403):
                            # The API takes only tenant tokens (AIKG_TENANTS_FILE) and this
                            # supervisor holds none: it asks the workers bucket itself.
                            user, password = _admin_login(settings, self.credentials)
                            listed = workers_over_nats(stack.nats_url, user, password)
                        else:
                            listed = answer.json().get("workers", [])
                        stack.workers = [w for w in listed if w.get("backend") == backend]
                        if stack.workers:
                            break
                if time.monotonic() > deadline:
                    raise StackError(f"AIKG did not come up in {ready_timeout:.0f} s "
                                     f"(gateway ready and a {backend} worker listed); see "
                                     "the logs" + (f" in {self.log_dir}" if self.logs else ""))
                stopping.wait(0.25)

    def supervise(self) -> Supervisor:
        """Start the :class:`Supervisor` of the children (and of the embedded NATS)."""
        procs: dict[str, subprocess.Popen[Any]] = dict(self.children)
        if self.nats is not None and self.nats.proc is not None:
            procs = {"nats": self.nats.proc, **procs}
        self.supervisor = Supervisor(
            procs, self.start_service, logs=self.logs,
            restart_max=self.settings.up_restart_max,
            window_s=self.settings.up_restart_window_s,
            backoff_max_s=self.settings.up_restart_backoff_max_s, say=self.say).start()
        return self.supervisor

    def stop(self) -> None:
        """Stop what was started, in order: no more restarts, the services, NATS, the
        supervisor's thread; then remove the run directory."""
        if self.supervisor is not None:
            self.supervisor.close()
        if self.children:
            self.say("stopping services ...")
        stop_children(self.children)
        if self.nats is not None:
            self.nats.stop()
        if self.supervisor is not None:
            self.supervisor.join()
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)


def _make_log_dir(log_dir: Path | None, say: Callable[[str], None]) -> Path:
    """Where the services' logs go: ``log_dir`` (created), else a new temporary one."""
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="aikg-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    say(f"logs: {log_dir}")
    return log_dir


def _service_env(nats_url: str, gateway_url: str, *, embedded: bool) -> dict[str, str]:
    """The services' environment: this one with the stack's NATS and gateway URLs;
    for an ``embedded`` server, without other ``AIKG_NATS_*`` variables."""
    env = {**os.environ, "AIKG_NATS_URL": nats_url, "AIKG_GATEWAY_URL": gateway_url,
           "PYTHONUNBUFFERED": "1"}
    if embedded:
        # The embedded server knows only its own users: credentials meant for
        # another server would be refused (or contradict the per-run ones).
        env = {k: v for k, v in env.items()
               if not k.startswith("AIKG_NATS_") or k in ("AIKG_NATS_URL", "AIKG_NATS_STORE_DIR")}
    return env


def _service_commands(host: str, port: int, backend: str, arch: str | None, devices: str, *,
                      nats_setup: bool, metrics_ports: dict[str, int]) -> dict[str, list[str]]:
    """Each service's ``aikg`` command line, in start order (``--metrics-port`` for the
    services named in ``metrics_ports``)."""
    def metrics(name: str) -> list[str]:
        return ["--metrics-port", str(metrics_ports[name])] if name in metrics_ports else []

    return {
        # As the admin: makes the JOBS/VERIFY consumers no service may create.
        **({"nats-setup": ["nats-setup", "--serve"]} if nats_setup else {}),
        "gateway": ["gateway", "--host", host, "--port", str(port)],
        "generator": ["generator", *metrics("generator")],
        "worker": ["worker", "--backend", backend, "--devices", devices,
                   *(["--arch", arch] if arch else []), *metrics("worker")],
    }


# The services of the stack with a /metrics port of their own, in the order of
# metrics_ports' base: the generator on the base, the worker on base + 1.
METRICS_SERVICES = ("generator", "worker")


def metrics_ports(base: int | None, fixed: bool = False) -> dict[str, int]:
    """The ``/metrics`` ports to give the stack's generator and worker.

    Args:
        base: the generator's port; the worker gets ``base + 1``
            (:data:`METRICS_SERVICES`). None: see ``fixed``.
        fixed: without ``base``, pick a free port for each now (another process may
            take one before the service binds it; the service then fails to start,
            naming the port in its log); False leaves them unset.

    Returns:
        Service name -> port; empty when neither is asked for.

    Raises:
        ValueError: a port past 65535, or below 1.
    """
    if base is None:
        picked: list[int] = []
        while fixed and len(picked) < len(METRICS_SERVICES):
            if (port := free_port()) not in picked:
                picked.append(port)
        return dict(zip(METRICS_SERVICES, picked, strict=False))
    ports = {name: base + i for i, name in enumerate(METRICS_SERVICES)}
    if base < 1 or max(ports.values()) > 65535:
        raise ValueError(f"metrics port base {base} leaves no room for "
                         f"{len(METRICS_SERVICES)} ports (1 to 65535)")
    return ports


def _loopback(host: str) -> str:
    """The address a client on this host reaches a server bound to ``host`` at."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host


def metrics_target(port: int) -> str:
    """``HOST:PORT`` of a /metrics server on ``port`` of this host, bound where
    :func:`~services.common.metrics.start_metrics_server` binds (``AIKG_METRICS_HOST``;
    ``0.0.0.0`` is reached at 127.0.0.1)."""
    from services.common.metrics import metrics_host

    return f"{_loopback(metrics_host())}:{port}"


def _metrics_endpoints(host: str, port: int, ports: dict[str, int]) -> dict[str, str]:
    """Service -> ``HOST:PORT`` of its /metrics: the gateway on its HTTP port, and each
    service of ``ports`` on its own (:func:`metrics_target`)."""
    return {"gateway": f"{_loopback(host)}:{port}",
            **{name: metrics_target(p) for name, p in ports.items()}}


def write_prometheus_targets(path: Path, endpoints: dict[str, str]) -> Path:
    """Write a Prometheus file_sd target list: one group per service, its ``HOST:PORT``
    with a ``service`` label (``[{"targets": ["127.0.0.1:8000"], "labels": {"service":
    "gateway"}}, ...]``), replacing ``path`` at once (a new file renamed over it:
    Prometheus, which re-reads the file when it changes, never sees half of it).

    Raises:
        OSError: the folder cannot be created or written.
    """
    groups = [{"targets": [where], "labels": {"service": name}}
              for name, where in endpoints.items()]
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(msgspec.json.format(msgspec.json.encode(groups), indent=2) + b"\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


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

    async def ignore(_: Exception) -> None:
        """nats-py's default error callback logs a traceback per error: not yet ready
        is no error here."""

    async def read() -> list[dict[str, Any]]:
        nc = await nats.connect(nats_url, user=user, password=password, error_cb=ignore,
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
