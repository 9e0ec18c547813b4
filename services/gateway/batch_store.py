"""The ``batches`` bucket and what a batch record says (services/gateway/batches.py
has the routes): :class:`BatchStore` (one :class:`~schemas.events.BatchRecord` per
batch id, every change a compare-and-swap on its revision), the plan of a batch's
candidates (identical ones share one request, :func:`plan_candidates`), and the pure
steps that change a record: verdicts folded in stream order (:func:`add_verdicts`),
candidates failed for an unserved lane (:func:`add_unserved`), whether a batch is
settled (:func:`settled`).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import nats.js.errors
from litestar.di import NamedDependency
from litestar.exceptions import HTTPException
from nats.js.kv import KeyValue

from schemas import BatchCandidate, BatchRecord, BatchVerdict, VerifyResult, decode, utcnow
from services.common.bus import Bus, create_record, update_record
from services.common.verify_client import originals

# Longest error text kept per verdict in the record, characters: a record holds up
# to batch_max_candidates verdicts and must stay well under NATS' 1 MiB payload; the
# whole error stays in the RESULTS stream.
ERROR_CHARS = 500
# Compare-and-swap attempts on a batch record before giving up (RuntimeError, a 500).
CAS_ATTEMPTS = 50


class BatchStore:
    """The ``batches`` bucket: one :class:`BatchRecord` per batch id.

    Raises (every method): ``nats.errors.Error`` when NATS fails (answered 503).
    """

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    async def get(self, batch_id: str) -> tuple[BatchRecord, int] | None:
        """The record and its revision, or None when there is none.

        Raises:
            RuntimeError: the stored value is not a BatchRecord (written by something
                other than AIKG); answered 500 naming the batch.
        """
        try:
            entry = await self.kv.get(batch_id)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        try:
            return decode(entry.value or b"", BatchRecord), entry.revision
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise RuntimeError(f"batch record {batch_id} is corrupt: {exc}") from exc

    async def create(self, record: BatchRecord) -> bool:
        """Create the record; False when the id is taken."""
        return await create_record(self.kv, record.batch_id, record)

    async def update(self, batch_id: str,
                     change: Callable[[BatchRecord], bool]) -> BatchRecord | None:
        """Apply ``change`` (True: it changed the record) by compare-and-swap, again on
        a fresh read when another write won; the record as stored, None when gone.

        Raises:
            RuntimeError: :data:`CAS_ATTEMPTS` writes all lost, or the record is corrupt.
        """
        return await update_record(self.kv, batch_id, lambda: self.get(batch_id),
                                   lambda record: record if change(record) else None,
                                   attempts=CAS_ATTEMPTS, what="batch")

    async def delete(self, batch_id: str) -> None:
        """Remove the record (a batch withdrawn before its requests went out)."""
        await self.kv.delete(batch_id)


def provide_batches(bus: NamedDependency[Bus]) -> BatchStore:
    """The ``batches`` bucket of the gateway's bus."""
    if bus.batches is None:  # a Bus built by hand without it
        raise HTTPException(status_code=503, detail="the gateway's bus has no batches "
                            "bucket; restart the gateway")
    return BatchStore(bus.batches)

def plan_candidates(batch_id: str, codes: list[str]) -> list[BatchCandidate]:
    """One :class:`BatchCandidate` per code, in order; a code whose normalised hash an
    earlier one has gets that one's request id and ``duplicate_of`` its index."""
    first, hashes = originals(codes)
    planned = []
    for index, (original, digest) in enumerate(zip(first, hashes, strict=True)):
        planned.append(BatchCandidate(
            index=index, candidate_id=f"{batch_id}-c{index}",
            request_id=f"{batch_id}-r{original}", code_hash=digest,
            duplicate_of=None if original == index else original))
    return planned


def settled(record: BatchRecord) -> bool:
    """Whether no more verdicts are awaited: every candidate has one or was cancelled
    unstarted (a cancelled batch's started verifications may still add one)."""
    decided = {v.index for v in record.verdicts}
    return all(c.index in decided or c.cancelled for c in record.candidates)


def add_verdicts(record: BatchRecord, results: list[tuple[int, VerifyResult]]) -> bool:
    """Append the verdicts of ``results`` (``(RESULTS sequence, result)``, in stream
    order) for each candidate of their request that has none yet; a running batch
    whose every candidate then has one is ``completed``. True when the record changed."""
    by_request: dict[str, list[BatchCandidate]] = {}
    for c in record.candidates:
        by_request.setdefault(c.request_id, []).append(c)
    decided = {v.index for v in record.verdicts}
    changed = False
    for seq, result in results:
        for c in by_request.get(result.request_id, []):
            if c.index in decided:
                continue
            decided.add(c.index)
            changed = True
            record.verdicts.append(BatchVerdict(
                index=c.index, candidate_id=c.candidate_id, request_id=c.request_id,
                passed=result.passed, stage=result.stage,
                error=(result.error or "")[:ERROR_CHARS] or None,
                duplicate_of=c.duplicate_of, speedup=result.speedup,
                base_time_us=result.base_time_us, gen_time_us=result.gen_time_us,
                max_abs_error=result.max_abs_error, trials=result.trials,
                interpreted=result.interpreted, duration_s=result.duration_s,
                worker_id=result.worker_id, reference_source=result.reference_source,
                baseline_source=result.baseline_source, finished_at=result.finished_at,
                seq=seq))
    if record.status == "running" and len(decided) == len(record.candidates):
        record.status, record.end_time, changed = "completed", utcnow(), True
    return changed


def add_unserved(record: BatchRecord, message: str) -> bool:
    """Give every candidate of a running ``record`` that has no verdict and was not
    cancelled a failed one (stage ``infrastructure``, ``error`` ``message``, no
    worker), and mark the batch ``completed``. True when the record changed."""
    if record.status != "running":
        return False
    decided = {v.index for v in record.verdicts}
    for c in record.candidates:
        if c.index in decided or c.cancelled:
            continue
        record.verdicts.append(BatchVerdict(
            index=c.index, candidate_id=c.candidate_id, request_id=c.request_id,
            passed=False, stage="infrastructure", error=message[:ERROR_CHARS],
            duplicate_of=c.duplicate_of))
    record.status, record.end_time = "completed", utcnow()
    return True

