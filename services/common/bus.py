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
from collections.abc import Awaitable, Callable
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
    "JobStore", "NatsAuthError", "auth_refused_message", "bucket_configs", "bucket_entries",
    "connect_bus", "create_record", "describe_error", "ensure_buckets", "ensure_streams",
    "inbox_prefix_of", "message_get_kv", "nats_credentials", "next_stored", "object_bytes",
    "open_nats", "stream_configs", "update_record",
]

log = structlog.get_logger("aikg.bus")

# How long connect_bus tries the first connection before giving up, seconds.
FIRST_CONNECT_TIMEOUT_S = 10.0
# nats-server's -ERR for a client whose credentials it does not accept (server/errors.go,
# ErrAuthentication: "Authorization Violation"), lower case.
_AUTH_REFUSED = "authorization violation"
# The nats.connect keyword arguments that carry credentials (nats_credentials).
_CREDENTIAL_KEYS = ("user", "password", "token", "nkeys_seed", "user_credentials")


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


class NatsAuthError(ConnectionError):
    """The NATS server refused this client's credentials (nats-server's ``-ERR
    'Authorization Violation'``): retrying the same ones cannot help. The message says
    which credentials were given and which settings to set."""


def describe_error(exc: BaseException) -> str:
    """``str(exc)``, or ``repr(exc)`` when that is empty (``TimeoutError()``): never an
    empty reason."""
    return str(exc).strip() or repr(exc)


def auth_refused_message(url: str, settings: Settings, credentials: dict[str, Any],
                         role: str | None = None) -> str:
    """One line for a connection the server refused: who was refused, which settings
    give credentials, and where ``aikg up`` writes its admin's
    (:func:`~services.common.embedded.admin_env_files`: the newest such file this user
    can see, else the pattern of its path).

    Args:
        url: the URL(s) connected to, as configured.
        settings: read for ``up_run_dir`` (where ``aikg up`` runs put their files).
        credentials: the ``nats.connect`` keyword arguments given
            (:func:`nats_credentials`).
        role: the service connecting, whose ``AIKG_NATS_<ROLE>_USER`` is named too.
    """
    from services.common.embedded import (
        ADMIN_ENV_FILE,
        UP_RUN_DIR_PREFIX,
        admin_env_files,
        up_run_dir_base,
    )

    given = [k for k in credentials if k in _CREDENTIAL_KEYS]
    user = credentials.get("user")
    who = (f"user {user!r}" if user else f"this {', '.join(given)}" if given
           else "a client without credentials")
    base = up_run_dir_base(settings.up_run_dir)
    found = admin_env_files(base)
    where = (str(found[0]) if found
             else str(base / f"{UP_RUN_DIR_PREFIX}<pid>-*" / ADMIN_ENV_FILE))
    which = f"AIKG_NATS_{role.upper()}_USER/_PASSWORD or " if role else ""
    return (f"cannot connect to NATS at {url}: authorization violation: {who} is not "
            f"allowed; the server refused this client's credentials (given: "
            f"{', '.join(given) or 'none'}): set {which}AIKG_NATS_USER/AIKG_NATS_PASSWORD "
            f"(aikg up writes them to {where}), AIKG_NATS_TOKEN, AIKG_NATS_NKEY_SEED_FILE "
            "or AIKG_NATS_CREDS_FILE to a user the server knows")


async def open_nats(url: str, name: str, credentials: dict[str, Any], *, settings: Settings,
                    role: str | None = None, timeout_s: float | None = None,
                    error_cb: Callable[[Exception], Awaitable[None]] | None = None,
                    **options: Any) -> NATS:
    """A nats-py connection to ``url`` (comma-separated servers) that reconnects forever
    once up, with the first connection tried for ``timeout_s`` seconds.

    nats-py retries the first connection too and reports each failed try to its error
    callback, whose default logs a traceback per try: here every error goes to
    ``error_cb`` (None: only recorded, for the message), and a refusal of the
    credentials ends the tries at once.

    Args:
        url: the server URL(s), comma-separated.
        name: the connection's name, shown by the server.
        credentials: ``nats.connect`` keyword arguments that authenticate
            (:func:`nats_credentials`) and any other (``inbox_prefix``).
        settings: read for the refusal's message (:func:`auth_refused_message`).
        role: the service connecting, named in that message.
        timeout_s: how long the first connection is tried, seconds; None:
            :data:`FIRST_CONNECT_TIMEOUT_S` (read at each call).
        error_cb: called with every error the client reports (a service logs them).
        options: further ``nats.connect`` keyword arguments (``disconnected_cb`` ...).

    Raises:
        NatsAuthError: the server refused the credentials (one line, naming them).
        ConnectionError: no server answered within ``timeout_s``; the message names the
            URL and the last error (never empty).
    """
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if not servers:
        raise ConnectionError("no NATS URL configured: set AIKG_NATS_URL or run `aikg up`")
    timeout_s = FIRST_CONNECT_TIMEOUT_S if timeout_s is None else timeout_s
    last_error: list[str] = []
    refused = asyncio.Event()

    async def on_error(exc: Exception) -> None:
        last_error[:] = [describe_error(exc)]
        if _AUTH_REFUSED in last_error[0].lower():
            refused.set()
        if error_cb is not None:
            await error_cb(exc)

    nc = NATS()
    # With max_reconnect_attempts=-1 nats-py retries the *first* connection forever
    # too; the deadline turns a wrong URL into an error instead of a silent hang, and
    # a refusal of the credentials ends it at once (retrying cannot help).
    connecting = asyncio.create_task(nc.connect(
        servers=servers, name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
        connect_timeout=min(5.0, timeout_s), allow_reconnect=True, error_cb=on_error,
        **options, **credentials))
    watching = asyncio.create_task(refused.wait())
    done, _ = await asyncio.wait({connecting, watching}, timeout=timeout_s,
                                 return_when=asyncio.FIRST_COMPLETED)
    watching.cancel()
    if connecting not in done:
        # One cancel() can be dropped inside nats-py's connect (asyncio.wait_for on
        # Python 3.11), and that connect retries forever: cancel until it ends.
        await cancel_and_wait(connecting)
        with contextlib.suppress(Exception):
            await nc.close()
    if refused.is_set() and not nc.is_connected:
        raise NatsAuthError(auth_refused_message(url, settings, credentials, role))
    try:
        if connecting not in done:
            raise TimeoutError
        connecting.result()
    except (TimeoutError, nats.errors.NoServersError, nats.errors.Error, OSError) as exc:
        reason = last_error[0] if last_error else describe_error(exc)
        raise ConnectionError(
            f"cannot reach NATS at {url} (tried for {timeout_s:g} s): {reason}") from None
    return nc


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
        NatsAuthError: the server refused the credentials (a ConnectionError; one line
            naming the settings to set, :func:`open_nats`).
        ConnectionError: no server answered at the URL; the message names the URL and
            the last error.
        ValueError: the credential settings are incomplete or name a missing file.
    """
    credentials = nats_credentials(settings, role)
    credentials["inbox_prefix"] = inbox_prefix_of(settings, credentials)

    async def on_error(exc: Exception) -> None:
        log.warning("nats_error", error=describe_error(exc), service=name)

    async def on_disconnect() -> None:
        log.warning("nats_disconnected", service=name)

    async def on_reconnect() -> None:
        log.info("nats_reconnected", service=name)

    # Replies to this process only: its user may subscribe to no other inbox
    # (services/common/nats_auth.py, inbox_prefix).
    nc = await open_nats(settings.nats_url, name, credentials, settings=settings, role=role,
                         error_cb=on_error, disconnected_cb=on_disconnect,
                         reconnected_cb=on_reconnect)
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
