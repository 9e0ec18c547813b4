"""AIKG's Python SDK: the reference document's client and worker API, over this system.

Full mode (a gateway runs the jobs)::

    from services.sdk import AIKGClient

    client = AIKGClient("http://localhost:8000")
    job_id = client.submit_job(op_name="relu", task_desc=source, job_type="single",
                               backend="cpu", dsl="triton", framework="torch",
                               workflow="coder_only_workflow")
    status = client.wait_for_completion(job_id, timeout=1800)

Worker-only mode (your code, AIKG's workers over NATS) and local mode (no NATS, no
network)::

    from services.sdk import Task, register_local_worker, register_remote_worker

    await register_remote_worker(backend="cuda", arch="h200")   # AIKG_NATS_URL
    # or: await register_local_worker([0], backend="cpu")
    op_name, passed, info = await Task(op_name="relu", task_desc=source,
                                       task_id="t1", backend="cpu").run()

``LocalWorker`` imports torch (through the worker's verifier) only when it starts;
importing this package does not.

Logging follows the library convention: the SDK prints nothing unless the application
configures logging. Its records go to stdlib loggers under ``aikg`` (and ``services``),
each with a :class:`logging.NullHandler`; importing this package routes structlog, when
nothing has configured it yet, into stdlib logging (:func:`_quiet_structlog`), so the
services' modules the SDK runs (the verifier, the verify client) log there too.
``logging.basicConfig(level=logging.INFO)`` shows them; the ``aikg`` services and CLI
configure structlog themselves (services/common/logging.py) and keep their output.
"""

import logging

import structlog

from services.sdk.client import (
    AIKGClient,
    AIKGConnectionError,
    AIKGError,
    AIKGHTTPError,
    AsyncAIKGClient,
)
from services.sdk.task import Task
from services.sdk.workers import (
    DevicePool,
    LocalWorker,
    NoWorkerError,
    RemoteWorker,
    WorkerManager,
    get_worker_manager,
    register_local_worker,
    register_remote_worker,
)


def _quiet_structlog() -> None:
    """Give the SDK's loggers a NullHandler and, unless structlog is configured already,
    send structlog's events to stdlib logging (one ``key=value`` line each, filtered by
    the stdlib logger's level) instead of structlog's default: print every event, info
    included, to stdout."""
    for name in ("aikg", "services"):
        logging.getLogger(name).addHandler(logging.NullHandler())
    if structlog.is_configured():
        return
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            structlog.contextvars.merge_contextvars,
            structlog.processors.format_exc_info,
            structlog.processors.KeyValueRenderer(key_order=["event"]),
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )


__all__ = [
    "AIKGClient",
    "AIKGConnectionError",
    "AIKGError",
    "AIKGHTTPError",
    "AsyncAIKGClient",
    "DevicePool",
    "LocalWorker",
    "NoWorkerError",
    "RemoteWorker",
    "Task",
    "WorkerManager",
    "get_worker_manager",
    "register_local_worker",
    "register_remote_worker",
]

_quiet_structlog()
