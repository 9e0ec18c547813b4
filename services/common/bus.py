"""NATS connection, idempotent JetStream bootstrap, and the ``jobs`` bucket store.

Every service calls :func:`connect_bus`; it connects with reconnect and creates any
stream or bucket that is missing (docs/architecture.md, "Names on the bus"), so the
services can start in any order against an empty server.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import importlib.util
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import nats
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS
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
from prometheus_client import Counter

from schemas import JobRecord, decode, encode, subjects, utcnow
from services.common.runtime import cancel_and_wait
from services.common.settings import NATS_ROLES, Settings

log = structlog.get_logger("aikg.bus")
# A record of a bucket (JobRecord, BatchRecord): a msgspec Struct with ``updated_at``.
_Record = TypeVar("_Record")

# Dedupe window of JOBS and VERIFY: a submit or verify request republished with the
# same Nats-Msg-Id within this many seconds is dropped by the server.
DUPLICATE_WINDOW_S = 120.0
# How long connect_bus tries the first connection before giving up, seconds.
FIRST_CONNECT_TIMEOUT_S = 10.0
# How long ensure_streams waits for the answer to a stream update, seconds.
STREAM_UPDATE_TIMEOUT_S = 3.0
# nats-server's -ERR for a client whose credentials it does not accept (server/errors.go,
# ErrAuthentication: "Authorization Violation"), lower case.
_AUTH_REFUSED = "authorization violation"
# Headers of a key's delete, purge or server-placed expiry marker (nats-server's
# KV-Operation, and Nats-Marker-Reason from 2.11 on).
_KV_MARKERS = ("KV-Operation", "Nats-Marker-Reason")
# Headers nats-server puts on a stored message it hands out raw (a direct get's reply):
# a stored message carrying them is a server-relayed copy, not a writer's put.
_RELAY_HEADERS = ("Nats-Stream", "Nats-Subject")

RELAYED_COPIES = Counter(
    "aikg_relayed_copies_skipped_total",
    "Stored key-value messages skipped because they carry the headers of a message the "
    "server relayed (Nats-Stream / Nats-Subject): a reply delivered onto a key's subject "
    "by a request naming it as its reply subject, not a write by the key's owner.",
    ["bucket"],
)


@dataclass
class Bus:
    """One NATS connection with its JetStream context and the three buckets."""

    nc: NATS
    js: JetStreamContext
    jobs: KeyValue
    workers: KeyValue
    leases: KeyValue
    settings: Settings
    # Per-tenant submission counts per hour (the gateway's jobs-per-hour limit).
    tenant_usage: KeyValue | None = None
    # Batch verifications (services/gateway/batches.py).
    batches: KeyValue | None = None

    async def close(self) -> None:
        """Flush and close the connection; safe to call twice."""
        if not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await self.nc.drain()
            with contextlib.suppress(Exception):
                await self.nc.close()


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


def _need_nkeys(variable: str) -> None:
    """Raise a clear error when nats-py's NKEY support (the ``nkeys`` package) is missing.

    Raises:
        ValueError: naming ``variable`` and the install command.
    """
    if importlib.util.find_spec("nkeys") is None:
        raise ValueError(f"{variable} needs the nkeys package: pip install 'aikg[nkeys]' "
                         "(or pip install nkeys)")


def _existing_file(settings: Settings, field: str) -> str:
    path = getattr(settings, field)
    if path and not Path(path).is_file():
        raise ValueError(f"AIKG_{field.upper()}={path!r} is not a readable file: "
                         "point it at the file, or leave it empty")
    return path


def nats_credentials(settings: Settings, role: str | None = None) -> dict[str, Any]:
    """Keyword arguments of ``nats.connect`` that authenticate this process.

    Args:
        settings: ``nats_user`` / ``nats_password``, ``nats_token``,
            ``nats_nkey_seed_file``, ``nats_creds_file`` and the ``nats_tls_*`` files.
        role: ``gateway``, ``generator`` or ``worker``: its ``nats_<role>_user`` /
            ``nats_<role>_password``, when set, take the place of ``nats_user`` /
            ``nats_password``.

    Returns:
        ``user``/``password``, ``token``, ``nkeys_seed``, ``user_credentials`` and
        ``tls`` (an ``ssl.SSLContext``) for those that are set; ``{}`` connects
        anonymously.

    Raises:
        ValueError: an incomplete or contradictory combination (a password without a
            user, a token with a user, a TLS key without its certificate), or a file
            that does not exist; the message names the variable.
    """
    if role is not None and role not in NATS_ROLES:
        raise ValueError(f"unknown NATS role {role!r}: one of {', '.join(NATS_ROLES)}")
    user, password = settings.nats_user, settings.nats_password
    if role is not None and getattr(settings, f"nats_{role}_user"):
        user = getattr(settings, f"nats_{role}_user")
        password = getattr(settings, f"nats_{role}_password")
    out: dict[str, Any] = {}
    if password and not user:
        raise ValueError("AIKG_NATS_PASSWORD is set but AIKG_NATS_USER is not: set both")
    if user:
        out.update(user=user, password=password)
    if settings.nats_token:
        if user:
            raise ValueError("AIKG_NATS_TOKEN and AIKG_NATS_USER are both set: a NATS "
                             "server takes one or the other; leave one empty")
        out["token"] = settings.nats_token
    if seed := _existing_file(settings, "nats_nkey_seed_file"):
        _need_nkeys("AIKG_NATS_NKEY_SEED_FILE")
        out["nkeys_seed"] = seed
    if creds := _existing_file(settings, "nats_creds_file"):
        _need_nkeys("AIKG_NATS_CREDS_FILE")
        out["user_credentials"] = creds
    ca = _existing_file(settings, "nats_tls_ca_file")
    cert = _existing_file(settings, "nats_tls_cert_file")
    key = _existing_file(settings, "nats_tls_key_file")
    if bool(cert) != bool(key):
        raise ValueError("AIKG_NATS_TLS_CERT_FILE and AIKG_NATS_TLS_KEY_FILE go together: "
                         "set both (a client certificate and its key) or neither")
    if ca or cert:
        try:
            tls = ssl.create_default_context(cafile=ca or None)
            if cert:
                tls.load_cert_chain(cert, key)
        except ssl.SSLError as exc:
            raise ValueError(f"cannot load the NATS TLS files (AIKG_NATS_TLS_CA_FILE={ca!r}, "
                             f"AIKG_NATS_TLS_CERT_FILE={cert!r}): {exc}") from exc
        out["tls"] = tls
    return out


def inbox_prefix_of(settings: Settings, credentials: dict[str, Any]) -> str:
    """The inbox prefix a client with ``credentials`` (:func:`nats_credentials`) takes:
    ``settings.nats_inbox_prefix``, else ``_INBOX_<user>`` for a user name (the only
    inbox a user of services/common/nats_auth.py may subscribe to), else ``_INBOX``."""
    user = credentials.get("user", "")
    return settings.nats_inbox_prefix or (
        f"_INBOX_{user}" if subjects.is_token(user, 200) else "_INBOX")


def _credentials_hint(settings: Settings, role: str | None) -> str:
    which = (f"AIKG_NATS_{role.upper()}_USER/_PASSWORD or " if role else "")
    given = ", ".join(k for k in nats_credentials(settings, role) if k != "tls") or "none"
    return (f"the server refused this client's credentials (given: {given}): set "
            f"{which}AIKG_NATS_USER/AIKG_NATS_PASSWORD, AIKG_NATS_TOKEN, "
            "AIKG_NATS_NKEY_SEED_FILE or AIKG_NATS_CREDS_FILE to a user the server knows")


async def connect_bus(settings: Settings, name: str, *, role: str | None = None) -> Bus:
    """Connect to ``settings.nats_url`` and make sure streams and buckets exist.

    Reconnects forever after the first connection (a cluster node restart must not
    end a worker); the first connection is tried for ~10 s. Replies come on the
    inbox prefix ``settings.nats_inbox_prefix``, by default ``_INBOX_<user>``.

    Args:
        settings: URL and credentials (:func:`nats_credentials`).
        name: the connection's name, shown by the server (``nats server report``).
        role: the service connecting (``gateway``, ``generator``, ``worker``), whose
            own credentials are used when the settings name them; None: the plain
            ``nats_user`` / ``nats_password`` (a test's or an operator's client).

    Raises:
        ConnectionError: no server answered at the URL, or it refused the
            credentials; the message names the URL.
        ValueError: the credential settings are incomplete or name a missing file.
    """
    servers = [u.strip() for u in settings.nats_url.split(",") if u.strip()]
    if not servers:
        raise ConnectionError("no NATS URL configured: set AIKG_NATS_URL or run `aikg up`")
    credentials = nats_credentials(settings, role)
    inbox = inbox_prefix_of(settings, credentials)

    last_error: list[str] = []
    refused = asyncio.Event()

    async def on_error(exc: Exception) -> None:
        last_error[:] = [str(exc) or exc.__class__.__name__]
        if _AUTH_REFUSED in last_error[0].lower():
            refused.set()
        log.warning("nats_error", error=str(exc), service=name)

    async def on_disconnect() -> None:
        log.warning("nats_disconnected", service=name)

    async def on_reconnect() -> None:
        log.info("nats_reconnected", service=name)

    nc = NATS()
    # With max_reconnect_attempts=-1 nats-py retries the *first* connection forever
    # too; the deadline turns a wrong URL into an error instead of a silent hang, and
    # a refusal of the credentials ends it at once (retrying cannot help).
    connecting = asyncio.create_task(nc.connect(
        servers=servers,
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        connect_timeout=5,
        allow_reconnect=True,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        # Replies to this process only: its user may subscribe to no other inbox
        # (services/common/nats_auth.py, inbox_prefix).
        inbox_prefix=inbox,
        **credentials,
    ))
    watching = asyncio.create_task(refused.wait())
    done, _ = await asyncio.wait({connecting, watching}, timeout=FIRST_CONNECT_TIMEOUT_S,
                                 return_when=asyncio.FIRST_COMPLETED)
    watching.cancel()
    if connecting not in done:
        # One cancel() can be dropped inside nats-py's connect (asyncio.wait_for on
        # Python 3.11), and that connect retries forever: cancel until it ends.
        await cancel_and_wait(connecting)
        with contextlib.suppress(Exception):
            await nc.close()
    if refused.is_set() and not nc.is_connected:
        raise ConnectionError(f"NATS at {settings.nats_url}: {_credentials_hint(settings, role)}")
    try:
        if connecting not in done:
            raise TimeoutError
        connecting.result()
    except (TimeoutError, nats.errors.NoServersError, OSError) as exc:
        raise ConnectionError(
            f"cannot reach NATS at {settings.nats_url} (tried for {FIRST_CONNECT_TIMEOUT_S:g} s): "
            f"{str(exc) or ''.join(last_error) or exc.__class__.__name__}"
        ) from exc
    js = nc.jetstream(timeout=10)
    await ensure_streams(js, settings)
    buckets = await ensure_buckets(js, settings)
    return Bus(
        nc=nc,
        js=js,
        jobs=buckets[subjects.BUCKET_JOBS],
        workers=buckets[subjects.BUCKET_WORKERS],
        leases=buckets[subjects.BUCKET_LEASES],
        settings=settings,
        tenant_usage=buckets[subjects.BUCKET_TENANT_USAGE],
        batches=buckets[subjects.BUCKET_BATCHES],
    )


async def bucket_entries(js: JetStreamContext, bucket: str) -> dict[str, KeyValue.Entry]:
    """The current entry (value, revision, ``created`` time) of every key of the
    key-value ``bucket``; deleted, purged and expired keys left out, and so are copies
    the server relayed into it.

    Read without a consumer (a service user may create none: services/common/nats_auth.py):
    the stream info of ``KV_<bucket>`` filtered on ``$KV.<bucket>.>`` lists the keys,
    then one ``STREAM.MSG.GET`` (last message of the key's subject; never ``DIRECT.GET``)
    per key gives its entry: one request per key, ~0.25 ms each on loopback (500 keys
    in 0.125 s, against 0.064 s for the pull consumer this replaced; measured with
    nats-server 2.15.1 on two shared cores), fine for the buckets' sizes (one key per
    worker, lease, job or batch). ``delta`` is 0 (no consumer counts what is
    pending). A key that expires between the listing and its get is left out.

    A stored message whose headers carry ``Nats-Stream`` or ``Nats-Subject`` is a copy
    the server delivered onto the key's subject as the reply of another request (a
    direct get or a pull whose asker named the key as its reply subject): it was not
    written by the key's writer, so it is left out, logged (``relayed_copy_skipped``)
    and counted (``aikg_relayed_copies_skipped_total``).

    Raises:
        nats.errors.Error: NATS trouble (timeouts, no permission, no such bucket).
    """
    stream, prefix = f"KV_{bucket}", f"$KV.{bucket}."
    info = await js.stream_info(stream, subjects_filter=f"{prefix}>")
    out: dict[str, KeyValue.Entry] = {}
    for subject in sorted(info.state.subjects or {}):
        try:
            raw = await js.get_msg(stream, subject=subject)
        except nats.js.errors.NotFoundError:
            continue  # expired (or purged) between the listing and the get
        headers = raw.headers or {}
        key = subject[len(prefix):]
        if any(h in headers for h in _KV_MARKERS):
            continue
        if any(h in headers for h in _RELAY_HEADERS):
            RELAYED_COPIES.labels(bucket=bucket).inc()
            log.warning("relayed_copy_skipped", bucket=bucket, key=key, seq=raw.seq,
                        relayed_from=headers.get("Nats-Stream"),
                        relayed_subject=headers.get("Nats-Subject"))
            continue
        out[key] = KeyValue.Entry(bucket=bucket, key=key, value=raw.data or b"",
                                  revision=raw.seq, delta=0, created=raw.time,
                                  operation=None)
    return out


async def next_stored(js: JetStreamContext, stream: str, subject: str,
                      after: int) -> Any | None:
    """The first message of ``stream`` on ``subject`` (wildcards allowed) after stream
    sequence ``after`` (a ``RawStreamMsg``: subject, seq, data, headers, time), read with
    ``$JS.API.STREAM.MSG.GET`` ``next_by_subj``, which needs no consumer; None when
    there is none yet.

    Raises:
        nats.errors.Error: NATS trouble (e.g. a timeout while the stream elects a leader).
    """
    try:
        raw = await js.get_msg(stream, seq=after + 1, subject=subject, next=True)
    except nats.js.errors.NotFoundError:
        return None
    if raw.seq is None or raw.seq <= after:
        return None
    return raw


async def object_bytes(js: JetStreamContext, store: str, name: str) -> bytes:
    """The content of object ``name`` of the object store ``store``, read without a
    consumer (nats-py's ``ObjectStore.get`` creates an ordered push consumer, which no
    service user may): its metadata (``ObjectStore.get_info``, a message get) names the
    chunks' subject, whose messages come one ``STREAM.MSG.GET`` (next by subject)
    each, checked against the metadata's chunk count, size and SHA-256 digest.

    Raises:
        nats.js.errors.ObjectNotFoundError: no such object (or deleted).
        nats.js.errors.BadObjectMetaError: a link, or metadata without chunks.
        nats.js.errors.DigestMismatchError: the chunks are not the object described.
        nats.errors.Error: NATS trouble.
    """
    info = await (await js.object_store(store)).get_info(name)
    if not info.nuid or info.is_link():
        raise nats.js.errors.BadObjectMetaError
    stream, subject = f"OBJ_{store}", f"$O.{store}.C.{info.nuid}"
    data, seq = bytearray(), 0
    for _ in range(info.chunks or 0):
        raw = await js.get_msg(stream, seq=seq + 1, subject=subject, next=True)
        seq = raw.seq or seq + 1
        data += raw.data or b""
    digest = (info.digest or "").split("=", 1)[-1]
    if len(data) != (info.size or 0) or hashlib.sha256(data).digest() != \
            base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)):
        raise nats.js.errors.DigestMismatchError
    return bytes(data)


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


async def publish_json(js: JetStreamContext, subject: str, record: Any,
                       *, msg_id: str | None = None) -> None:
    """Publish ``record`` as JSON on a stream subject, with ``Nats-Msg-Id`` when given."""
    headers = {"Nats-Msg-Id": msg_id} if msg_id else None
    await js.publish(subject, encode(record), headers=headers)
