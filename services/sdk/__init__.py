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
"""

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
