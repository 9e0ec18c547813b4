"""The baselines of a worker: kept in its own process and shared by every worker on
JetStream.

A worker's :class:`BaselineCache` keeps baseline timings in its own process (the first
tier) and in a second tier that every worker reads and writes (:class:`SharedCache`),
so a profile of a task another worker (or this one, before a restart) has already
timed does not time the reference again: key-value bucket ``baselines``, one key per
baseline (the reference ``Model`` timed on a device: ``eager`` as it is, ``compile``
compiled with ``torch.compile``), named by :func:`baseline_key` (kind, task, shapes,
backend, arch, torch, CUDA runtime and driver versions), value :class:`Baseline` with
the time it was measured, so a result can say how old its baseline is. Eager entries
written before compiled baselines existed keep their keys and decode unchanged
(``kind`` defaults to ``eager``); a failed ``torch.compile`` is not shared (each
worker process keeps its own failure).

Reference *outputs* are not shared: every verification draws its inputs from secret
seeds of its own (:mod:`services.worker.inputs`), so no two verifications have the
same reference to share.

The bucket has a size bound and a TTL (settings ``baseline_cache_*``). JetStream
creates key-value buckets with ``discard: new``: once it is full a put is refused and
the entry stays in the worker's own cache until the TTL has removed old entries. Every
failure of the shared tier (NATS away, a full bucket, a malformed entry) is a miss,
counted in ``aikg_worker_cache_errors_total``, never a failed verification.

Trust: only the ``worker`` NATS user may write the bucket (services/common/nats_auth.py);
only the worker process writes it, with what a reference child (which runs the task's
``Model`` and never candidate code) measured.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec
import nats.js.errors
import structlog
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from prometheus_client import Counter

from schemas import subjects, utcnow
from schemas.events import VerifyRequest
from services.common.bus import message_get_kv
from services.common.settings import Settings

log = structlog.get_logger("aikg.worker.cache")

# Version of the key recipe and the entry layout; a change makes old entries misses.
CACHE_FORMAT = 1
# One shared-cache call (a get, a put) may take this long, seconds, before it counts
# as a miss (or a failed put): a verification never waits longer on the cache.
SHARED_CALL_TIMEOUT_S = 30.0

CACHE_LOOKUPS = Counter(
    "aikg_worker_cache_lookups_total",
    "Lookups of reference outputs (kind=reference: always a miss, every verification "
    "draws its own inputs), eager baselines (kind=baseline) and torch.compile baselines "
    "(kind=compile) by one verification, by "
    "where they were found: worker (this process), shared (the JetStream bucket), or "
    "miss (the reference ran).",
    ["backend", "arch", "kind", "result"],
)
CACHE_ERRORS = Counter(
    "aikg_worker_cache_errors_total",
    "Shared-cache calls that failed (NATS away, bucket full, timeout) or found a "
    "malformed entry; each counts as a miss.",
    ["kind", "op"],
)


class Baseline(msgspec.Struct, kw_only=True):
    """A baseline: median time of the reference ``Model``, microseconds, ``kind``
    ``eager`` (as it is) or ``compile`` (``torch.compile(Model)``).

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
    kind: str = "eager"

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
    """What timings depend on besides the task and shapes."""

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
        # str(): torch.__version__ is a TorchVersion, which msgspec does not encode.
        return cls(torch=str(torch.__version__),
                   cuda=str(torch.version.cuda or "") if gpu else "",
                   driver=_driver_version() if gpu else "",
                   default_dtype=str(torch.get_default_dtype()).removeprefix("torch."))


def _digest(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


# ``eager``: the task's Model as it is; ``compile``: torch.compile(Model).
BaselineKind = Literal["eager", "compile"]
BASELINE_KINDS: tuple[BaselineKind, ...] = ("eager", "compile")
# Where a baseline came from: measured now, this process's cache, the shared bucket.
BaselineOrigin = Literal["measured", "worker_cache", "shared_cache"]


def baseline_key(*, task_sha256: str, shapes: str, backend: str, arch: str,
                 versions: Versions, kind: str = "eager") -> str:
    """Key of a baseline of ``kind`` (:data:`BASELINE_KINDS`) in bucket ``baselines``:
    64 hex digits (an eager key is what it was before compiled baselines existed).

    Raises:
        ValueError: an unknown ``kind``.
    """
    if kind not in BASELINE_KINDS:
        raise ValueError(f"baseline kind must be one of {', '.join(BASELINE_KINDS)}, "
                         f"not {kind!r}")
    return _digest({"format": CACHE_FORMAT, "kind": kind, "task": task_sha256,
                    "shapes": shapes, "backend": backend, "arch": arch,
                    "torch": versions.torch, "cuda": versions.cuda,
                    "driver": versions.driver})


class MalformedEntry(ValueError):
    """A stored entry that does not decode or does not match its key."""


class SharedCache:
    """The ``baselines`` bucket of one worker's bus.

    Args:
        baselines: the open key-value bucket.
        worker_id: recorded in the entries this worker writes.
        timeout_s: limit on each call, seconds.
    """

    def __init__(self, baselines: Any, *, worker_id: str,
                 timeout_s: float = SHARED_CALL_TIMEOUT_S) -> None:
        self.baselines = baselines
        self.worker_id = worker_id
        self.timeout_s = timeout_s

    @classmethod
    async def open(cls, js: JetStreamContext, settings: Settings, *,
                   worker_id: str) -> SharedCache | None:
        """Open the bucket, creating it with the settings' bounds when missing.

        Returns:
            None when ``baseline_cache_bytes`` is 0 (the shared tier is off).

        Raises:
            nats.errors.Error: JetStream refused or did not answer (the worker then
                runs with its own cache only).
        """
        if settings.baseline_cache_bytes <= 0:
            return None
        try:
            await js.key_value(subjects.BUCKET_BASELINES)
        except nats.js.errors.BucketNotFoundError:
            await js.create_key_value(KeyValueConfig(
                bucket=subjects.BUCKET_BASELINES,
                description="AIKG baseline timings (eager, torch.compile) shared by workers",
                history=1, ttl=settings.baseline_cache_ttl_s, direct=False,
                max_bytes=settings.baseline_cache_bytes, storage=StorageType.FILE,
                replicas=settings.stream_replicas))
        # Reads by STREAM.MSG.GET: a worker may not use DIRECT.GET (nats_auth.py).
        return cls(message_get_kv(js, subjects.BUCKET_BASELINES), worker_id=worker_id)

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
        if baseline.key != key or baseline.format != CACHE_FORMAT or \
                baseline.kind not in BASELINE_KINDS or not (
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


@dataclass
class BaseTime:
    """A baseline as a worker process holds it: median time (us), when it was measured
    (UTC), and where this process got it (``measured`` here or ``shared``); ``error``:
    why it could not be measured (a failed ``torch.compile``, kept in this process
    only; ``median_us`` is 0 then)."""

    median_us: float
    measured_at: dt.datetime
    origin: str
    error: str = ""


def task_key(request: VerifyRequest) -> tuple[str, str]:
    """(sha256 of the task source, the shape_overrides as canonical JSON)."""
    return (hashlib.sha256(request.task_desc.encode()).hexdigest(),
            json.dumps(request.shape_overrides, sort_keys=True))


class BaselineCache:
    """The baselines one worker process knows: its own (by kind, task, arch and
    shapes) and, when ``shared`` is set, the ``baselines`` bucket every worker shares.

    Args:
        backend: the worker's backend (part of every key).
        versions: what timings depend on besides the task (part of every shared key;
            default: this process's, :meth:`Versions.detect`).

    Attributes:
        shared: the shared tier (None: this process only).
    """

    def __init__(self, backend: str, versions: Versions | None = None) -> None:
        self.backend = backend
        self.versions = versions or Versions.detect(backend)
        self.shared: SharedCache | None = None
        self._times: dict[tuple[str, str, str, str], BaseTime] = {}

    def clear(self) -> None:
        """Forget this process's baselines (the shared tier keeps its entries)."""
        self._times.clear()

    def key(self, request: VerifyRequest, task_sha: str, overrides: str,
            kind: BaselineKind = "eager") -> str:
        """The shared key of ``request``'s baseline of ``kind`` (:func:`baseline_key`)."""
        return baseline_key(task_sha256=task_sha, shapes=overrides, backend=self.backend,
                            arch=request.arch, versions=self.versions, kind=kind)

    async def cached(self, request: VerifyRequest, kind: BaselineKind = "eager"
                     ) -> tuple[BaseTime | None, BaselineOrigin]:
        """The baseline of ``kind`` of ``request``'s task, arch and shapes from this
        process (``worker_cache``) or the shared bucket (``shared_cache``, then kept
        here), or (None, ``measured``) when it must be measured. A ``compile`` failure
        this process saw comes back with its ``error``."""
        task_sha, overrides = task_key(request)
        held = (kind, task_sha, request.arch, overrides)
        base = self._times.get(held)
        if base is not None:
            return base, "worker_cache"
        if self.shared is not None:
            found = await self.shared.get_baseline(self.key(request, task_sha, overrides, kind))
            if found is not None:
                base = self._times[held] = BaseTime(found.median_us, found.measured_at,
                                                    "shared")
                return base, "shared_cache"
        return None, "measured"

    async def keep(self, request: VerifyRequest, kind: BaselineKind, median_us: float,
                   error: str = "") -> BaseTime:
        """Keep a measured baseline of ``kind`` (microseconds) in this process and (not
        a failure: ``error`` empty) in the shared bucket; returns it."""
        task_sha, overrides = task_key(request)
        base = self._times[kind, task_sha, request.arch, overrides] = BaseTime(
            median_us, utcnow(), "measured", error)
        if self.shared is not None and not error:
            await self.shared.put_baseline(Baseline(
                format=CACHE_FORMAT, key=self.key(request, task_sha, overrides, kind),
                median_us=median_us, measured_at=base.measured_at, task_sha256=task_sha,
                shapes=overrides, backend=self.backend, arch=request.arch, kind=kind,
                versions={"torch": self.versions.torch, "cuda": self.versions.cuda,
                          "driver": self.versions.driver}))
        return base
