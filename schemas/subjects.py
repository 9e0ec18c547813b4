"""Every NATS subject, stream, consumer and bucket name AIKG uses, in one place.

docs/architecture.md ("Names on the bus") describes what each carries;
`nats` CLI users and non-Python clients rely on them, so they are part of the public
contract.
"""

from __future__ import annotations

import re

# Subjects.
JOBS_SUBMIT = "jobs.submit"
JOB_EVENTS_PREFIX = "jobs.events"
VERIFY_PREFIX = "verify"
RESULTS_PREFIX = "results"
DLQ_PREFIX = "dlq"
# Request/reply (no stream captures these: a stream would answer with its PubAck).
WORKER_SERVICE_PREFIX = "aikg.worker"
# Asked by a generator or worker for a lane's durable consumer, answered by the
# admin-side provisioner (services/common/provision.py): services may not create
# consumers on JOBS and VERIFY themselves.
PROVISION_CONSUMER = "aikg.provision.consumer"
# Headers-only copies of stored verify requests (the VERIFY stream's republish):
# ``aikg.wake.verify.<backend>.<arch>[.<tenant>.<priority>]``; no stream captures them.
WAKE_PREFIX = "aikg.wake"

# Streams.
STREAM_JOBS = "JOBS"
STREAM_JOB_EVENTS = "JOB_EVENTS"
STREAM_VERIFY = "VERIFY"
STREAM_RESULTS = "RESULTS"
STREAM_DLQ = "DLQ"

# Durable consumers.
CONSUMER_GENERATOR = "generator"

# Tenants and priorities (docs/architecture.md, "Tenants and fair scheduling"). A job
# or verify request of tenant ``t`` at priority ``p`` waits on its own subject (a
# "lane") with its own durable consumer, so the generator and the workers can take
# one request per tenant in turn. The default tenant at normal priority keeps the
# subjects without a lane suffix (``jobs.submit``, ``verify.<backend>.<arch>``), which
# raw ``nats pub`` users and older clients publish to.
DEFAULT_TENANT = "default"
DEFAULT_PRIORITY = "normal"
# Served in this order: a lane of a higher priority is emptied before a lower one.
PRIORITIES = ("high", "normal", "low")
TENANT_PATTERN = r"^[A-Za-z0-9_]{1,32}$"

# Key-value buckets.
BUCKET_JOBS = "jobs"
BUCKET_WORKERS = "workers"
BUCKET_LEASES = "leases"
# Baseline timings shared by every worker, eager and torch.compile, one key per kind
# (services/worker/cache.py).
BUCKET_BASELINES = "baselines"
BUCKET_TENANT_USAGE = "tenant_usage"
# Batch verifications (services/gateway/batches.py): one BatchRecord per batch id.
BUCKET_BATCHES = "batches"

# Object store bucket for kernel sources, logs and checkpoints.
OBJECT_STORE_ARTIFACTS = "artifacts"

# One NATS subject token as AIKG uses them (job ids, backends, arches, device names):
# no dots (they split a subject), no spaces or wildcards (they widen it).
TOKEN_PATTERN = r"^[A-Za-z0-9_-]+$"
_TOKEN = re.compile(TOKEN_PATTERN)


def is_token(value: object, max_length: int = 64) -> bool:
    """Whether ``value`` is a str usable as one subject token, 1 to ``max_length`` characters."""
    return isinstance(value, str) and 0 < len(value) <= max_length and bool(_TOKEN.match(value))


_TENANT = re.compile(TENANT_PATTERN)


def _token(kind: str, value: str) -> str:
    """Return ``value`` if it is one NATS subject token (no dots, spaces or wildcards).

    Raises:
        ValueError: when ``value`` would split or widen the subject.
    """
    if not _TOKEN.match(value or ""):
        raise ValueError(
            f"{kind} {value!r} is not usable in a NATS subject: use letters, digits, '_' or '-'"
        )
    return value


def tenant_name(value: str) -> str:
    """Return ``value`` if it can name a tenant: 1 to 32 letters, digits or ``_`` (no
    ``-``, so lane consumer names split back unambiguously).

    Raises:
        ValueError: naming the value and the rule.
    """
    if not isinstance(value, str) or not _TENANT.match(value):
        raise ValueError(f"tenant name {value!r} is not usable: use 1 to 32 letters, digits "
                         "or '_'")
    return value


def _priority(value: str) -> str:
    if value not in PRIORITIES:
        raise ValueError(f"priority {value!r} is not one of {', '.join(PRIORITIES)}")
    return value


def is_default_lane(tenant: str, priority: str) -> bool:
    """Whether ``tenant``/``priority`` use the subjects without a lane suffix."""
    return tenant == DEFAULT_TENANT and priority == DEFAULT_PRIORITY


def job_submit(tenant: str = DEFAULT_TENANT, priority: str = DEFAULT_PRIORITY) -> str:
    """Subject a job of ``tenant`` at ``priority`` is queued on: ``jobs.submit`` for the
    default tenant at normal priority, else ``jobs.submit.<tenant>.<priority>``.

    Raises:
        ValueError: a tenant name or priority that is not allowed.
    """
    if is_default_lane(tenant_name(tenant), _priority(priority)):
        return JOBS_SUBMIT
    return f"{JOBS_SUBMIT}.{tenant}.{priority}"


def generator_consumer(tenant: str = DEFAULT_TENANT, priority: str = DEFAULT_PRIORITY) -> str:
    """Durable consumer of one JOBS lane, shared by every generator:
    ``generator`` (default lane) or ``generator-<tenant>-<priority>``."""
    if is_default_lane(tenant_name(tenant), _priority(priority)):
        return CONSUMER_GENERATOR
    return f"{CONSUMER_GENERATOR}-{tenant}-{priority}"


def verify_lane(backend: str, arch: str, tenant: str = DEFAULT_TENANT,
                priority: str = DEFAULT_PRIORITY) -> str:
    """Subject of verify requests of one tenant and priority: ``verify.<backend>.<arch>``
    (default lane) or ``verify.<backend>.<arch>.<tenant>.<priority>``."""
    base = verify(backend, arch)
    if is_default_lane(tenant_name(tenant), _priority(priority)):
        return base
    return f"{base}.{tenant}.{priority}"


def verify_lane_consumer(backend: str, arch: str, tenant: str = DEFAULT_TENANT,
                         priority: str = DEFAULT_PRIORITY) -> str:
    """Durable consumer of one VERIFY lane: ``verify-<backend>-<arch>`` (default lane) or
    ``verify-<backend>-<arch>-<priority>-<tenant>`` (a tenant name holds no ``-``)."""
    base = verify_consumer(backend, arch)
    if is_default_lane(tenant_name(tenant), _priority(priority)):
        return base
    return f"{base}-{priority}-{tenant}"


def parse_lane(base: str, subject: str) -> tuple[str, str] | None:
    """``(tenant, priority)`` of a lane subject under ``base`` (``jobs.submit``,
    ``verify.cpu.x86_64``): the default lane for ``base`` itself, None for a subject
    that is no lane (a bad tenant name or priority, other tokens)."""
    if subject == base:
        return DEFAULT_TENANT, DEFAULT_PRIORITY
    if not subject.startswith(base + "."):
        return None
    parts = subject[len(base) + 1:].split(".")
    if len(parts) != 2 or not _TENANT.match(parts[0]) or parts[1] not in PRIORITIES:
        return None
    return parts[0], parts[1]


def job_events(job_id: str) -> str:
    """Subject of one job's events: ``jobs.events.<job_id>``."""
    return f"{JOB_EVENTS_PREFIX}.{_token('job_id', job_id)}"


def verify(backend: str, arch: str) -> str:
    """Subject of verify requests for one backend and arch: ``verify.<backend>.<arch>``."""
    return f"{VERIFY_PREFIX}.{_token('backend', backend)}.{_token('arch', arch)}"


def results(job_id: str, worker_id: str) -> str:
    """Subject of the worker ``worker_id``'s verdicts and claims on one job's verify
    requests: ``results.<job_id>.<worker_id>``. A worker's user may publish only on
    ``results.*.<its worker_id>`` (services/common/nats_auth.py), so the last token
    says which worker sent a message.

    Raises:
        ValueError: ``job_id`` or ``worker_id`` is not one subject token.
    """
    return f"{RESULTS_PREFIX}.{_token('job_id', job_id)}.{_token('worker_id', worker_id)}"


def claims(job_id: str, worker_id: str) -> str:
    """Subject of the worker ``worker_id``'s claims of one job's verify requests:
    ``results.<job_id>.<worker_id>.claim`` (beside its verdicts, so one filter reads
    both in order, and ``results.<job_id>.*`` counts verdicts alone)."""
    return f"{results(job_id, worker_id)}.claim"


def job_verdicts(job_id: str) -> str:
    """Filter of one job's verdicts (not claims): ``results.<job_id>.*``."""
    return f"{RESULTS_PREFIX}.{_token('job_id', job_id)}.*"


def job_results(job_id: str) -> str:
    """Filter of every message on one job's verify requests: ``results.<job_id>.>``."""
    return f"{RESULTS_PREFIX}.{_token('job_id', job_id)}.>"


def results_sender(subject: str) -> tuple[str, bool] | None:
    """``(worker id, is a claim)`` of a ``results.<job_id>.<worker_id>[.claim]``
    subject, else None."""
    parts = subject.split(".")
    claim = len(parts) == 4 and parts[3] == "claim"
    if len(parts) != 3 + claim or parts[0] != RESULTS_PREFIX or not _TOKEN.match(parts[2]):
        return None
    return parts[2], claim


def verify_wake(subject: str) -> str:
    """Where the VERIFY stream republishes the headers (not the body) of each request
    it stores on ``subject`` (a ``verify.>`` lane): ``aikg.wake.<subject>``. Workers
    wake on these: a request's body (with its claim nonce) reaches only the worker
    JetStream delivers it to."""
    return f"{WAKE_PREFIX}.{subject}"


def dlq(subject: str) -> str:
    """Dead-letter subject for a message that arrived on ``subject``: ``dlq.<subject>``."""
    return f"{DLQ_PREFIX}.{subject}"


def verify_consumer(backend: str, arch: str) -> str:
    """Durable consumer name shared by every worker of one backend and arch.

    JetStream hands each message of a durable pull consumer to one fetcher, so all
    workers of ``cuda``/``h200`` pulling from ``verify-cuda-h200`` form a queue group.
    """
    return f"verify-{_token('backend', backend)}-{_token('arch', arch)}"


def worker_service(worker_id: str) -> str:
    """Request/reply subject prefix of one worker's control endpoints."""
    return f"{WORKER_SERVICE_PREFIX}.{_token('worker_id', worker_id)}"
