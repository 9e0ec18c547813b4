"""Job records: pure logic, no NATS.

What both doors of a job (the gateway's HTTP submit and a raw ``nats pub`` on
``jobs.submit`` read by the generator) need without a bus: building a ``pending``
record, decoding a stored record, choosing an arch among live
workers, and the normalised hash by which identical candidates are recognised (an
evolve job's duplicates, a batch verification's). The NATS side (the checked job
store, events, cancel) is :mod:`services.common.jobs`; checking a task's source and
its shape overrides is :mod:`services.common.task_source`.
"""

from __future__ import annotations

import ast
import hashlib

import msgspec

from schemas import JobRecord, JobSubmit, WorkerInfo, decode, new_id, subjects, utcnow
from services.common.pyast import parse

# Longest piece of a decoder's complaint kept in a corrupt record's error text, characters.
_FAULT_CHARS = 300


class JobRecordCorrupt(Exception):
    """A job's value in the ``jobs`` bucket does not decode as a :class:`JobRecord`.

    Written by something other than AIKG (``nats kv put``, a task's code with bus
    access, a newer or broken client) or truncated. Not a :class:`JobNotFound`: the
    job exists, its record cannot be read.

    Attributes:
        job_id: the key.
        fault: what the decoder said (``JSON is malformed: ...`` or ``Expected `str`,
            got `int` - at `$.status```), at most 300 characters.
        revision: the key's revision holding the bad value, for a compare-and-swap
            that replaces exactly that value.
    """

    def __init__(self, job_id: str, fault: str, revision: int | None = None) -> None:
        self.job_id = job_id
        self.fault = fault[:_FAULT_CHARS]
        self.revision = revision
        super().__init__(f"job record {job_id} is corrupt: {self.fault}")


def decode_record(job_id: str, value: bytes) -> JobRecord:
    """Decode a ``jobs`` bucket value, naming the job when it does not decode.

    Raises:
        JobRecordCorrupt: not JSON, or JSON that breaks the :class:`JobRecord` schema.
    """
    try:
        return decode(value, JobRecord)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise JobRecordCorrupt(job_id, str(exc) or exc.__class__.__name__) from exc


def normalised_hash(code: str) -> str:
    """sha256 (hex) of the code's AST dump: comments, blank lines and formatting do
    not count, names and constants do.

    Falls back to the raw text for code that does not parse, or nests too deep for
    the parser (:class:`SyntaxError`, :class:`ValueError` for a NUL byte,
    :class:`RecursionError`, :class:`MemoryError`): such code fails verification at
    the compile stage anyway, and equal text still hashes equal. Never raises.
    """
    try:
        text = ast.dump(parse(code), annotate_fields=False)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        text = code
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def new_record(submit: JobSubmit, *, job_id: str | None = None, arch: str | None = None,
               tenant: str = subjects.DEFAULT_TENANT, priority: str | None = None) -> JobRecord:
    """A ``pending`` job record for ``submit`` (id from the submit, the argument, or new),
    of ``tenant``, at ``priority`` (the submission's when None)."""
    job_id = submit.job_id or job_id or new_id("job-")
    submit.job_id = job_id
    if arch:
        submit.arch = arch
    return JobRecord(
        job_id=job_id,
        status="pending",
        job_type=submit.job_type,
        op_name=submit.op_name,
        submit_time=utcnow(),
        backend=submit.backend,
        arch=submit.arch,
        request=submit,
        tenant=tenant,
        priority=priority or submit.priority,
    )


def pick_arch(workers: list[WorkerInfo], backend: str, arch: str | None) -> str | None:
    """The arch to run on: ``arch`` when a live worker offers backend/arch, else the
    arch of the least loaded live worker of ``backend`` when ``arch`` is None; None when
    no live worker matches."""
    matching = [w for w in workers if w.backend == backend and (arch is None or w.arch == arch)]
    if not matching:
        return None
    if arch is not None:
        return arch
    best = min(matching, key=lambda w: w.in_flight / max(w.capacity, 1))
    return best.arch


def describe_pairs(workers: list[WorkerInfo]) -> list[str]:
    """Sorted ``backend/arch`` pairs with a live worker, for error messages."""
    return sorted({f"{w.backend}/{w.arch}" for w in workers})


def attempt_ids(job_id: str, attempt: int) -> tuple[str, str]:
    """Deterministic ``(candidate_id, request_id)`` of a job's attempt.

    ``<job_id>-c<n>`` / ``<job_id>-a<n>``; a job id too long for a 64-character
    subject token is shortened with a hash of it, still deterministic.
    """
    base = job_id
    if len(job_id) + 6 > 64:
        base = f"{job_id[:40]}-{hashlib.sha256(job_id.encode()).hexdigest()[:12]}"
    return f"{base}-c{attempt}", f"{base}-a{attempt}"


def request_id_of(candidate_id: str) -> str:
    """The request id :func:`attempt_ids` pairs with ``candidate_id``
    (``<base>-c<n>`` -> ``<base>-a<n>``).

    Raises:
        ValueError: ``candidate_id`` is not one :func:`attempt_ids` makes.
    """
    base, sep, number = candidate_id.rpartition("-c")
    if not sep or not number.isdigit():
        raise ValueError(f"{candidate_id!r} is not an attempt's candidate id (<job>-c<n>)")
    return f"{base}-a{number}"

