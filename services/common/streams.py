"""The AIKG streams and key-value buckets: their configuration, and the idempotent
bootstrap every service runs when it connects (docs/architecture.md, "Names on the
bus"), so the services can start in any order against an empty server.
"""

from __future__ import annotations

import asyncio
from typing import Any

import nats.errors
import nats.js.errors
import structlog
from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    KeyValueConfig,
    RePublish,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.kv import KeyValue

from schemas import subjects
from services.common.settings import Settings

log = structlog.get_logger("aikg.bus")

# Dedupe window of JOBS and VERIFY: a submit or verify request republished with the
# same Nats-Msg-Id within this many seconds is dropped by the server.
DUPLICATE_WINDOW_S = 120.0
# How long ensure_streams waits for the answer to a stream update, seconds.
STREAM_UPDATE_TIMEOUT_S = 3.0


def stream_configs(settings: Settings) -> list[StreamConfig]:
    """The five streams (docs/architecture.md, "Subjects and streams") with their
    retention and limits; all are file-stored with ``stream_replicas`` replicas."""

    def stream(name: str, filters: list[str], retention: RetentionPolicy, **limits: Any
               ) -> StreamConfig:
        return StreamConfig(name=name, subjects=filters, retention=retention,
                            storage=StorageType.FILE, num_replicas=settings.stream_replicas,
                            **limits)

    # The work queues keep a message at most queue_max_age_s (a stray on a lane no
    # service takes goes by itself; a request's waiter gave up long before: the
    # generator after verify_result_timeout_s, every waiter after
    # verify_unserved_timeout_s without a worker) and hold at most queue_max_msgs: a
    # publish beyond it is refused (discard new), so no queued message is dropped to
    # make room (docs/operations.md, "Stream limits").
    queue_limits: dict[str, Any] = dict(
        duplicate_window=min(DUPLICATE_WINDOW_S, settings.queue_max_age_s or DUPLICATE_WINDOW_S),
        max_age=settings.queue_max_age_s,
        max_msgs=settings.queue_max_msgs, discard=DiscardPolicy.NEW)
    return [
        # jobs.submit (default tenant, normal priority) and the tenant lanes
        # jobs.submit.<tenant>.<priority> (services/common/lanes.py): a publish with
        # another priority token, or more tokens, is refused (no stream takes it).
        # NATS subjects cannot say which characters a token holds, so a message on
        # a lane whose tenant token is no tenant name is stored and moved to the
        # DLQ by the generator (LanePull.sweep_strays).
        stream(subjects.STREAM_JOBS,
               [subjects.JOBS_SUBMIT,
                *(f"{subjects.JOBS_SUBMIT}.*.{p}" for p in subjects.PRIORITIES)],
               RetentionPolicy.WORK_QUEUE, **queue_limits),
        stream(subjects.STREAM_JOB_EVENTS, [f"{subjects.JOB_EVENTS_PREFIX}.>"],
               RetentionPolicy.LIMITS, max_age=settings.job_events_max_age_s),
        # Each stored request's headers (not its body, which holds the requester's
        # claim nonce) are republished on aikg.wake.verify.> to wake idle workers
        # (services/common/lanes.py, services/common/verdicts.py).
        stream(subjects.STREAM_VERIFY, [f"{subjects.VERIFY_PREFIX}.>"],
               RetentionPolicy.WORK_QUEUE,
               republish=RePublish(src=f"{subjects.VERIFY_PREFIX}.>",
                                   dest=subjects.verify_wake(f"{subjects.VERIFY_PREFIX}.>"),
                                   headers_only=True),
               **queue_limits),
        stream(subjects.STREAM_RESULTS, [f"{subjects.RESULTS_PREFIX}.>"],
               RetentionPolicy.LIMITS,
               max_age=settings.results_max_age_s, duplicate_window=DUPLICATE_WINDOW_S),
        stream(subjects.STREAM_DLQ, [f"{subjects.DLQ_PREFIX}.>"],
               RetentionPolicy.LIMITS,
               max_age=settings.job_events_max_age_s, discard=DiscardPolicy.OLD),
    ]


def bucket_configs(settings: Settings) -> list[KeyValueConfig]:
    """The ``jobs``, ``workers``, ``leases``, ``tenant_usage`` and ``batches`` buckets,
    file-stored with ``stream_replicas`` replicas.

    ``workers`` expires a key three heartbeats after its last put; ``leases`` after
    ten, so a crashed worker's leases go by themselves; ``tenant_usage`` (one counter
    per tenant and clock hour) after two hours; ``batches`` (one record per batch
    verification) after ``job_events_max_age_s`` (7 days), as a job's events do.
    ``jobs`` keeps five revisions of a key and never expires one. None allows direct
    gets (``direct=False``): no service user may use them (services/common/nats_auth.py).
    """
    hb = settings.worker_heartbeat_s
    lives = {subjects.BUCKET_WORKERS: 3 * hb, subjects.BUCKET_LEASES: 10 * hb,
             subjects.BUCKET_TENANT_USAGE: 2 * 3600.0,
             subjects.BUCKET_BATCHES: settings.job_events_max_age_s}
    return [KeyValueConfig(bucket=subjects.BUCKET_JOBS, history=5, direct=False,
                           replicas=settings.stream_replicas, storage=StorageType.FILE),
            *(KeyValueConfig(bucket=bucket, history=1, ttl=ttl, direct=False,
                             replicas=settings.stream_replicas, storage=StorageType.FILE)
              for bucket, ttl in lives.items())]


async def ensure_streams(js: JetStreamContext, settings: Settings) -> None:
    """Create each stream, or update it when it exists with another configuration.

    A service user may create the AIKG streams but not change them
    (services/common/nats_auth.py): the server drops a refused update without a reply,
    so after ``STREAM_UPDATE_TIMEOUT_S`` the stream is used as it is, with a warning
    naming it (an operator updates it as ``admin``).
    """
    for cfg in stream_configs(settings):
        try:
            await js.add_stream(cfg)
        except nats.js.errors.BadRequestError as exc:
            # 10058: name in use with a different configuration.
            if exc.err_code != 10058:
                raise
            try:
                await asyncio.wait_for(js.update_stream(cfg), STREAM_UPDATE_TIMEOUT_S)
            except (TimeoutError, nats.errors.TimeoutError):
                log.warning("stream_config_differs", stream=cfg.name,
                            hint="this NATS user may not update streams (a permissions "
                                 "violation is logged above): update it as the admin user, "
                                 "e.g. `nats stream edit`, or align the settings")


async def ensure_buckets(js: JetStreamContext, settings: Settings) -> dict[str, KeyValue]:
    """Create the buckets that are missing and return a handle for each.

    Each handle reads keys with ``STREAM.MSG.GET`` even when the bucket's stream allows
    direct gets (one made by another tool: ``nats kv add`` allows them): nats-py's
    ``KeyValue`` would otherwise use ``DIRECT.GET``, which no service user may.
    """
    out: dict[str, KeyValue] = {}
    for cfg in bucket_configs(settings):
        try:
            await js.key_value(cfg.bucket)
        except nats.js.errors.BucketNotFoundError:
            await js.create_key_value(cfg)
        out[cfg.bucket] = message_get_kv(js, cfg.bucket)
    return out


def message_get_kv(js: JetStreamContext, bucket: str) -> KeyValue:
    """A handle of the existing key-value ``bucket`` whose reads use ``STREAM.MSG.GET``,
    never ``DIRECT.GET`` (which nats-py picks when the stream allows direct gets)."""
    return KeyValue(name=bucket, stream=f"KV_{bucket}", pre=f"$KV.{bucket}.", js=js,
                    direct=False)
