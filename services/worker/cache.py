"""Reference outputs and eager baselines shared by every worker, on JetStream.

A worker's :class:`~services.worker.verifier.Verifier` keeps reference runs and
baseline timings in its own process; this module adds a second tier that every
worker reads and writes, so a job whose task another worker (or this one, before a
restart) has already run does not run the reference again:

- object store ``references``: one object per reference run of one seed, named by
  :func:`reference_key` (sha256 of the task source's sha256, the shape_overrides,
  the seed, backend, arch, torch version, CUDA runtime version and torch's default
  dtype). The dtypes of the outputs are fixed by the task source (in the key) and
  the default dtype; each entry records every output's dtype and shape, and both are
  checked when it is read. Object layout: an 8-byte big-endian header length, the
  JSON :class:`ReferenceHeader`, then each output's raw bytes in order.
- key-value bucket ``baselines``: one key per eager baseline (the reference
  ``Model`` timed on a device), named by :func:`baseline_key` (task, shapes, backend,
  arch, torch, CUDA runtime and driver versions), value :class:`Baseline` with the
  time it was measured, so a result can say how old its baseline is.

Both have a size bound and a TTL (settings ``reference_cache_*`` /
``baseline_cache_*``). JetStream creates object stores and key-value buckets with
``discard: new`` (nats-py's ``create_object_store`` / ``create_key_value``): once a
bucket is full a put is refused and the entry stays in the worker's own cache until
the TTL has removed old entries. Every failure of the shared tier (NATS away, a full
bucket, a malformed entry) is a miss, counted in ``aikg_worker_cache_errors_total``,
never a failed verification.

Trust: these entries decide verdicts (a candidate is compared with the reference
outputs read here), so only the ``worker`` NATS user may write either bucket
(services/common/nats_auth.py; the gateway and generator cannot even read them).
Only the worker process writes them, and only with what a reference child (which
runs the task's ``Model`` and never candidate code) sent; candidate children run with
no NATS credentials in their environment and, where the machine permits, in a
network namespace with no route to the bus. Entries are keyed by the task source's
hash, so a job can only ever meet entries of its own task.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import io
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import nats.js.errors
import structlog
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, ObjectStoreConfig, StorageType
from prometheus_client import Counter

from schemas import subjects, utcnow
from services.common.settings import Settings

log = structlog.get_logger("aikg.worker.cache")

# Version of the key recipe and the object layout; a change makes old entries misses.
CACHE_FORMAT = 1
# One shared-cache call (a get, a put) may take this long, seconds, before it counts
# as a miss (or a failed put): a verification never waits longer on the cache.
SHARED_CALL_TIMEOUT_S = 30.0
_HEADER_LEN = struct.Struct(">Q")
# A header is a few KiB (digests, names); anything larger is not one of ours.
_MAX_HEADER_BYTES = 1 << 20

CACHE_LOOKUPS = Counter(
    "aikg_worker_cache_lookups_total",
    "Lookups of reference outputs (kind=reference) and eager baselines (kind=baseline) "
    "by one verification, by where they were found: worker (this process), shared (the "
    "JetStream buckets), or miss (the reference ran).",
    ["backend", "arch", "kind", "result"],
)
CACHE_ERRORS = Counter(
    "aikg_worker_cache_errors_total",
    "Shared-cache calls that failed (NATS away, bucket full, timeout) or found a "
    "malformed entry; each counts as a miss.",
    ["kind", "op"],
)


class TensorEntry(msgspec.Struct):
    """dtype (``float32``), shape and byte count of one stored output."""

    dtype: str
    shape: list[int]
    nbytes: int


class ReferenceHeader(msgspec.Struct, kw_only=True):
    """What a stored reference run holds besides its output bytes.

    ``inputs_before`` / ``inputs_after``: sha256 digests of each input before and
    after the reference's forward call; ``aliasing``: outputs that share memory with
    inputs; ``input_bytes`` / ``size_names``: the task's input size and module-level
    ints at these shapes (the verifier sizes candidate limits and second sizes with
    them).
    """

    format: int
    key: str
    seed: int
    outputs: list[TensorEntry]
    inputs_before: list[str]
    inputs_after: list[str]
    aliasing: list[str]
    input_bytes: int
    size_names: dict[str, int]
    worker_id: str = ""
    created_at: dt.datetime | None = None


class Baseline(msgspec.Struct, kw_only=True):
    """An eager baseline: median time of the reference ``Model``, microseconds.

    ``measured_at``: when a worker measured it (UTC); ``versions``: the library and
    driver versions it was measured with (also in the key).
    """

    format: int
    key: str
    median_us: float
    measured_at: dt.datetime
    task_sha256: str
    shapes: str
    backend: str
    arch: str
    versions: dict[str, str]
    worker_id: str = ""

    def age_s(self, now: dt.datetime | None = None) -> float:
        """Seconds since it was measured (0 when the clocks disagree the other way)."""
        return max(0.0, ((now or utcnow()) - self.measured_at).total_seconds())


def _driver_version() -> str:
    """The NVIDIA kernel driver's version from /proc (no CUDA call: the worker process
    must not initialise CUDA before it forks children), or ``""``."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return ""
    # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar ..."
    for word in text.split():
        if word.count(".") >= 1 and word.replace(".", "").isdigit():
            return word
    return ""


@dataclass(frozen=True)
class Versions:
    """What reference outputs and timings depend on besides the task and shapes."""

    torch: str
    cuda: str
    driver: str
    default_dtype: str

    @classmethod
    def detect(cls, backend: str) -> Versions:
        """This process's versions; ``cuda`` and ``driver`` only on the cuda backend.

        Reads ``torch.version.cuda`` and /proc: neither initialises CUDA.
        """
        import torch

        gpu = backend == "cuda"
        return cls(torch=torch.__version__, cuda=(torch.version.cuda or "") if gpu else "",
                   driver=_driver_version() if gpu else "",
                   default_dtype=str(torch.get_default_dtype()).removeprefix("torch."))


def _digest(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def reference_key(*, task_sha256: str, shapes: str, seed: int, backend: str, arch: str,
                  versions: Versions) -> str:
    """Name of one seed's reference run: 64 hex digits.

    Args:
        task_sha256: sha256 of the task source (hex).
        shapes: the shape_overrides as canonical JSON (sorted keys).
        seed: the trial's seed.
    """
    return _digest({"format": CACHE_FORMAT, "kind": "reference", "task": task_sha256,
                    "shapes": shapes, "seed": seed, "backend": backend, "arch": arch,
                    "torch": versions.torch, "cuda": versions.cuda,
                    "default_dtype": versions.default_dtype})


def baseline_key(*, task_sha256: str, shapes: str, backend: str, arch: str,
                 versions: Versions) -> str:
    """Key of an eager baseline in bucket ``baselines``: 64 hex digits."""
    return _digest({"format": CACHE_FORMAT, "kind": "eager", "task": task_sha256,
                    "shapes": shapes, "backend": backend, "arch": arch,
                    "torch": versions.torch, "cuda": versions.cuda,
                    "driver": versions.driver})


def encode_reference(header: ReferenceHeader, outputs: list[bytes | memoryview]) -> bytes:
    """The object's bytes: header length, header JSON, then each output's bytes."""
    head = msgspec.json.encode(header)
    return b"".join([_HEADER_LEN.pack(len(head)), head, *outputs])


class MalformedEntry(ValueError):
    """A stored entry that does not decode or does not match its key."""


def decode_reference(data: bytes, key: str) -> tuple[ReferenceHeader, list[bytearray]]:
    """Header and each output's bytes of a stored reference run.

    Raises:
        MalformedEntry: a short object, a bad header, a key that differs from the
            object's name, or output sizes that do not add up to the bytes stored.
    """
    if len(data) < _HEADER_LEN.size:
        raise MalformedEntry(f"{len(data)} bytes: shorter than a header length")
    (size,) = _HEADER_LEN.unpack_from(data)
    if size > min(_MAX_HEADER_BYTES, len(data) - _HEADER_LEN.size):
        raise MalformedEntry(f"header length {size} does not fit the object")
    start = _HEADER_LEN.size + size
    try:
        header = msgspec.json.decode(data[_HEADER_LEN.size:start], type=ReferenceHeader)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise MalformedEntry(f"header: {exc}") from None
    if header.format != CACHE_FORMAT or header.key != key:
        raise MalformedEntry(f"entry {header.key[:12]} (format {header.format}) stored "
                             f"under {key[:12]}")
    if any(t.nbytes < 0 for t in header.outputs) or (
            start + sum(t.nbytes for t in header.outputs) != len(data)):
        raise MalformedEntry("output sizes do not add up to the object's size")
    parts = []
    for t in header.outputs:
        parts.append(bytearray(data[start:start + t.nbytes]))
        start += t.nbytes
    return header, parts


class SharedCache:
    """The ``references`` object store and ``baselines`` bucket of one worker's bus.

    Args:
        references / baselines: the open object store and key-value bucket.
        worker_id: recorded in the entries this worker writes.
        entry_bytes: largest object put or read, bytes.
        timeout_s: limit on each call, seconds.
    """

    def __init__(self, references: Any, baselines: Any, *, worker_id: str,
                 entry_bytes: int, timeout_s: float = SHARED_CALL_TIMEOUT_S) -> None:
        self.references = references
        self.baselines = baselines
        self.worker_id = worker_id
        self.entry_bytes = entry_bytes
        self.timeout_s = timeout_s

    @classmethod
    async def open(cls, js: JetStreamContext, settings: Settings, *,
                   worker_id: str) -> SharedCache | None:
        """Open both buckets, creating the missing ones with the settings' bounds.

        Returns:
            None when ``reference_cache_bytes`` is 0 (the shared tier is off).

        Raises:
            nats.errors.Error: JetStream refused or did not answer (the worker then
                runs with its own cache only).
        """
        if settings.reference_cache_bytes <= 0:
            return None
        try:
            references = await js.object_store(subjects.OBJECT_STORE_REFERENCES)
        except nats.js.errors.BucketNotFoundError:
            references = await js.create_object_store(
                subjects.OBJECT_STORE_REFERENCES, ObjectStoreConfig(
                    description="AIKG reference outputs shared by workers "
                                "(services/worker/cache.py)",
                    ttl=settings.reference_cache_ttl_s,
                    max_bytes=settings.reference_cache_bytes,
                    storage=StorageType.FILE, replicas=settings.stream_replicas))
        try:
            baselines = await js.key_value(subjects.BUCKET_BASELINES)
        except nats.js.errors.BucketNotFoundError:
            baselines = await js.create_key_value(KeyValueConfig(
                bucket=subjects.BUCKET_BASELINES,
                description="AIKG eager baseline timings shared by workers",
                history=1, ttl=settings.baseline_cache_ttl_s,
                max_bytes=settings.baseline_cache_bytes, storage=StorageType.FILE,
                replicas=settings.stream_replicas))
        return cls(references, baselines, worker_id=worker_id,
                   entry_bytes=settings.reference_cache_entry_bytes)

    async def get_reference(self, key: str) -> tuple[ReferenceHeader, list[bytearray]] | None:
        """The stored run named ``key``, or None (absent, too large, malformed, or the
        call failed: each but absence counted in ``aikg_worker_cache_errors_total``)."""
        try:
            async with asyncio.timeout(self.timeout_s):
                info = await self.references.get_info(key)
                if info.size is not None and info.size > self.entry_bytes:
                    return None
                buffer = io.BytesIO()
                await self.references.get(key, writeinto=buffer)
        except (nats.js.errors.ObjectNotFoundError, nats.js.errors.ObjectDeletedError):
            return None
        except Exception as exc:  # noqa: BLE001 - any failure of the shared tier is a miss
            self._failed("reference", "get", key, exc)
            return None
        try:
            return decode_reference(buffer.getvalue(), key)
        except MalformedEntry as exc:
            self._failed("reference", "decode", key, exc)
            return None

    async def put_reference(self, header: ReferenceHeader,
                            outputs: list[bytes | memoryview]) -> bool:
        """Store one reference run under ``header.key``; False when it is larger than
        ``entry_bytes`` or the put failed (counted)."""
        header.worker_id = header.worker_id or self.worker_id
        header.created_at = header.created_at or utcnow()
        data = encode_reference(header, outputs)
        if len(data) > self.entry_bytes:
            return False
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.references.put(header.key, data)
        except Exception as exc:  # noqa: BLE001 - the worker's own cache still has it
            self._failed("reference", "put", header.key, exc)
            return False
        return True

    async def get_baseline(self, key: str) -> Baseline | None:
        """The baseline under ``key``, or None (absent, malformed or failed: counted)."""
        try:
            async with asyncio.timeout(self.timeout_s):
                entry = await self.baselines.get(key)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        except Exception as exc:  # noqa: BLE001 - a miss
            self._failed("baseline", "get", key, exc)
            return None
        try:
            baseline = msgspec.json.decode(entry.value or b"", type=Baseline)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            self._failed("baseline", "decode", key, exc)
            return None
        if baseline.key != key or baseline.format != CACHE_FORMAT or not (
                baseline.median_us > 0 and baseline.median_us < float("inf")):
            self._failed("baseline", "decode", key, MalformedEntry("key or time does not fit"))
            return None
        return baseline

    async def put_baseline(self, baseline: Baseline) -> bool:
        """Store ``baseline`` under its key; False when the put failed (counted)."""
        baseline.worker_id = baseline.worker_id or self.worker_id
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.baselines.put(baseline.key, msgspec.json.encode(baseline))
        except Exception as exc:  # noqa: BLE001 - the worker's own cache still has it
            self._failed("baseline", "put", baseline.key, exc)
            return False
        return True

    def _failed(self, kind: str, op: str, key: str, exc: BaseException) -> None:
        CACHE_ERRORS.labels(kind=kind, op=op).inc()
        log.warning("shared_cache_failed", kind=kind, op=op, key=key[:16],
                    error=str(exc) or type(exc).__name__)

