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

# Streams.
STREAM_JOBS = "JOBS"
STREAM_JOB_EVENTS = "JOB_EVENTS"
STREAM_VERIFY = "VERIFY"
STREAM_RESULTS = "RESULTS"
STREAM_DLQ = "DLQ"

# Durable consumers.
CONSUMER_GENERATOR = "generator"

# Key-value buckets.
BUCKET_JOBS = "jobs"
BUCKET_WORKERS = "workers"
BUCKET_LEASES = "leases"
# Eager baseline timings shared by every worker (services/worker/cache.py).
BUCKET_BASELINES = "baselines"

# Object store bucket for kernel sources, logs and checkpoints.
OBJECT_STORE_ARTIFACTS = "artifacts"
# Object store bucket for reference outputs shared by every worker (services/worker/cache.py).
OBJECT_STORE_REFERENCES = "references"

# One NATS subject token as AIKG uses them (job ids, backends, arches, device names):
# no dots (they split a subject), no spaces or wildcards (they widen it).
TOKEN_PATTERN = r"^[A-Za-z0-9_-]+$"
_TOKEN = re.compile(TOKEN_PATTERN)


def is_token(value: object, max_length: int = 64) -> bool:
    """Whether ``value`` is a str usable as one subject token, 1 to ``max_length`` characters."""
    return isinstance(value, str) and 0 < len(value) <= max_length and bool(_TOKEN.match(value))


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


def job_events(job_id: str) -> str:
    """Subject of one job's events: ``jobs.events.<job_id>``."""
    return f"{JOB_EVENTS_PREFIX}.{_token('job_id', job_id)}"


def verify(backend: str, arch: str) -> str:
    """Subject of verify requests for one backend and arch: ``verify.<backend>.<arch>``."""
    return f"{VERIFY_PREFIX}.{_token('backend', backend)}.{_token('arch', arch)}"


def results(job_id: str) -> str:
    """Subject of one job's verify results: ``results.<job_id>``."""
    return f"{RESULTS_PREFIX}.{_token('job_id', job_id)}"


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
