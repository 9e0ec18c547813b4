"""The NATS connection of every service: credentials, the connection with reconnect,
and the bootstrap of the streams and buckets it runs (:mod:`services.common.streams`).

Every service calls :func:`connect_bus`; it connects with reconnect and creates any
stream or bucket that is missing (docs/architecture.md, "Names on the bus"), so the
services can start in any order against an empty server. The bus's other pieces
live beside it and are re-exported here: the streams' and buckets' configuration
(:mod:`services.common.streams`), reads without a consumer
(:mod:`services.common.stored`) and records changed by compare-and-swap
(:mod:`services.common.record_store`).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats.errors
import structlog
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from schemas import subjects
from services.common.record_store import JobNotFound, JobStore, create_record, update_record
from services.common.runtime import cancel_and_wait
from services.common.settings import NATS_ROLES, Settings
from services.common.stored import RELAYED_COPIES, bucket_entries, next_stored, object_bytes
from services.common.streams import (
    DUPLICATE_WINDOW_S,
    bucket_configs,
    ensure_buckets,
    ensure_streams,
    message_get_kv,
    stream_configs,
)

__all__ = [
    "DUPLICATE_WINDOW_S", "FIRST_CONNECT_TIMEOUT_S", "RELAYED_COPIES", "Bus", "JobNotFound",
    "JobStore", "bucket_configs", "bucket_entries", "connect_bus", "create_record",
    "ensure_buckets", "ensure_streams", "inbox_prefix_of", "message_get_kv",
    "nats_credentials", "next_stored", "object_bytes", "stream_configs", "update_record",
]

log = structlog.get_logger("aikg.bus")

# How long connect_bus tries the first connection before giving up, seconds.
FIRST_CONNECT_TIMEOUT_S = 10.0
# nats-server's -ERR for a client whose credentials it does not accept (server/errors.go,
# ErrAuthentication: "Authorization Violation"), lower case.
_AUTH_REFUSED = "authorization violation"


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
