"""Records in key-value buckets, changed only by compare-and-swap: a record's create
and update (:func:`create_record`, :func:`update_record`, for any bucket of records)
and the job records of the ``jobs`` bucket (:class:`JobStore`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats.js.errors
from nats.js.kv import KeyValue

from schemas import JobRecord, decode, encode, utcnow

# A record of a bucket (JobRecord, BatchRecord): a msgspec Struct with ``updated_at``.
_Record = TypeVar("_Record")


async def create_record(kv: KeyValue, key: str, record: Any) -> bool:
    """Write ``record`` as JSON under ``key`` unless the key holds a value already.

    Returns:
        True when written; False when ``key`` has a value (the record exists).

    Raises:
        nats.errors.Error: NATS trouble.
    """
    try:
        await kv.create(key, encode(record))
    except nats.js.errors.KeyWrongLastSequenceError:
        return False
    return True


async def update_record(kv: KeyValue, key: str,
                        read: Callable[[], Awaitable[tuple[_Record, int] | None]],
                        change: Callable[[_Record], _Record | None], *, attempts: int,
                        what: str) -> _Record | None:
    """Change the record under ``key`` by compare-and-swap on its revision, reading it
    again and retrying (after 10 ms) when another write won.

    Args:
        read: the current record and its revision, or None when there is none.
        change: the new record (``updated_at`` is set here), or None to leave it as is.
        attempts: writes tried before giving up.
        what: the kind of record, for the error message (``job``, ``batch``).

    Returns:
        The record as stored (the old one when ``change`` left it), or None when
        ``read`` found none.

    Raises:
        RuntimeError: ``attempts`` writes all lost a race.
        nats.errors.Error: NATS trouble; whatever ``read`` raises.
    """
    for _ in range(attempts):
        found = await read()
        if found is None:
            return None
        record, revision = found
        new = change(record)
        if new is None:
            return record
        new.updated_at = utcnow()
        try:
            await kv.update(key, encode(new), last=revision)
            return new
        except nats.js.errors.KeyWrongLastSequenceError:
            await asyncio.sleep(0.01)
    raise RuntimeError(f"{what} {key}: {attempts} concurrent updates lost")


class JobNotFound(KeyError):
    """No record for this job id in the ``jobs`` bucket."""


class JobStore:
    """Job records in the ``jobs`` bucket, changed only by compare-and-swap.

    Args:
        kv: the ``jobs`` bucket.
    """

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    async def create(self, record: JobRecord) -> bool:
        """Write a new record; False when the id already has one (an idempotent resubmit)."""
        return await create_record(self.kv, record.job_id, record)

    async def get(self, job_id: str) -> tuple[JobRecord, int]:
        """The record and its revision.

        Raises:
            JobNotFound: no such job.
        """
        try:
            entry = await self.kv.get(job_id)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError) as exc:
            raise JobNotFound(job_id) from exc
        assert entry.value is not None and entry.revision is not None
        return decode(entry.value, JobRecord), entry.revision

    async def update(
        self, job_id: str, change: Callable[[JobRecord], JobRecord | None], *, attempts: int = 20
    ) -> JobRecord:
        """Apply ``change`` to the current record and write it back by CAS, retrying on races.

        ``change`` receives a copy and returns the new record, or None to leave it as is.

        Raises:
            JobNotFound: no such job.
            RuntimeError: the key kept changing under us ``attempts`` times.
        """
        new = await update_record(self.kv, job_id, lambda: self.get(job_id), change,
                                  attempts=attempts, what="job")
        assert new is not None  # self.get raises instead of finding nothing
        return new
