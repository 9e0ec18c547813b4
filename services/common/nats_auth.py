"""Who may do what on the bus: one NATS user per service, with least privilege.

Each service connects as its own user (``gateway``, ``generator``, ``worker``); the
server refuses anonymous clients, and a fourth user, ``admin``, has every right (the
``nats`` CLI of an operator). :data:`PERMISSIONS` is the one source of each service's
rights: :func:`authorization_block` renders it into nats-server's configuration
syntax for ``aikg up``'s embedded server, the tests' servers and
``deploy/nats/auth.conf`` (regenerate that with ``python -m services.common.nats_auth``;
``tests/test_deploy_files.py`` checks that it matches).

The rights are subjects a user may publish to and subscribe on, in nats-server's
``authorization { users = [ {user, password, permissions} ] }`` form
(https://docs.nats.io/running-a-nats-service/configuration/securing_nats/authorization).
Everything JetStream does is a publish on a subject (the ``JSApi*`` subject constants
of nats-server's ``server/jetstream_api.go``, https://github.com/nats-io/nats-server):

- ``$JS.API.STREAM.INFO.<stream>``, ``$JS.API.STREAM.CREATE.<stream>``: look up and
  create a stream (a key-value bucket ``b`` is the stream ``KV_b``, an object store
  ``o`` the stream ``OBJ_o``);
- ``$JS.API.CONSUMER.CREATE.<stream>[.<name>[.<filter>]]``,
  ``$JS.API.CONSUMER.DURABLE.CREATE.<stream>.<name>``, ``...INFO...``,
  ``...DELETE...``: manage a consumer; ``$JS.API.CONSUMER.MSG.NEXT.<stream>.<name>``:
  pull messages from it; ``$JS.ACK.<stream>.>``: acknowledge them;
  ``$JS.FC.<stream>.>``: answer an ordered consumer's flow control;
- ``$KV.<bucket>.<key>``: put, update (with ``Nats-Expected-Last-Subject-Sequence``)
  and delete a key (a delete is a put with a ``KV-Operation`` header), so write access
  to a bucket is publish access to ``$KV.<bucket>.>``;
- ``$JS.API.DIRECT.GET.<stream>.>`` / ``$JS.API.STREAM.MSG.GET.<stream>``: read a key;
  a watch or key listing is a consumer on ``KV_<bucket>`` (a listing pulls from it);
- ``$O.<store>.>``: object store chunks and metadata;
- ``_INBOX.>``: replies to the client's requests (JetStream API answers, PubAcks) and
  its push consumers' deliveries; ``$SRV.>``: ``nats micro`` discovery.

Nothing here lets a worker write the ``jobs`` bucket, a generator publish a verdict on
``results.>``, or the gateway consume ``verify.>``; nor anyone but a worker write (or
read) the workers' shared cache of eager baselines (bucket ``baselines``), whose entries
a verdict's speedup is computed against. No service may update or delete a
stream: each may create the AIKG streams and buckets that are missing (so services
start in any order on an empty server), but changing an existing stream's
configuration takes the ``admin`` user.
"""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from schemas import subjects
from services.common.settings import NATS_ROLES

# The service users and the operator's user, as named in a deployed configuration.
ROLES = NATS_ROLES
ADMIN_USER = "admin"

_KV = {b: f"KV_{b}" for b in (subjects.BUCKET_JOBS, subjects.BUCKET_WORKERS,
                               subjects.BUCKET_LEASES, subjects.BUCKET_TENANT_USAGE)}
_OBJ = f"OBJ_{subjects.OBJECT_STORE_ARTIFACTS}"
# The workers' shared cache of eager baselines (services/worker/cache.py): they decide
# speedups, so only the worker user may create, write or read it.
_KV_BASELINES = f"KV_{subjects.BUCKET_BASELINES}"
# Every stream any service may create when it is missing (services/common/bus.py and
# the generator's artifact store).
STREAMS = (subjects.STREAM_JOBS, subjects.STREAM_JOB_EVENTS, subjects.STREAM_VERIFY,
           subjects.STREAM_RESULTS, subjects.STREAM_DLQ, *_KV.values(), _OBJ)


def _common() -> list[str]:
    """What every service does at start: look streams up and create missing ones."""
    return ["$JS.API.INFO", "$JS.API.STREAM.NAMES", "$JS.API.STREAM.INFO.*",
            *(f"$JS.API.STREAM.CREATE.{s}" for s in STREAMS)]


def _read(stream: str) -> list[str]:
    """Read a stream: ephemeral consumers on it (ordered push, or pull as a bucket
    listing's), and single-message gets."""
    return [f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}.>",
            f"$JS.API.CONSUMER.INFO.{stream}.>", f"$JS.API.CONSUMER.DELETE.{stream}.>",
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.>",
            f"$JS.API.STREAM.MSG.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}",
            f"$JS.API.DIRECT.GET.{stream}.>", f"$JS.FC.{stream}.>"]


def _consume(stream: str, durable: str) -> list[str]:
    """Pull from (and create, look up) the durable consumer(s) ``durable`` of ``stream``."""
    return [f"$JS.API.CONSUMER.CREATE.{stream}.{durable}",
            f"$JS.API.CONSUMER.CREATE.{stream}.{durable}.>",
            f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{durable}",
            f"$JS.API.CONSUMER.INFO.{stream}.{durable}",
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}", f"$JS.ACK.{stream}.>"]


def _sweep(stream: str) -> list[str]:
    """Read and delete single messages of ``stream`` (by subject and sequence)."""
    return [f"$JS.API.STREAM.MSG.GET.{stream}", f"$JS.API.STREAM.MSG.DELETE.{stream}"]


@dataclass(frozen=True)
class Permissions:
    """One user's rights: subjects it may publish to and subscribe on.

    ``allow_responses``: it may also reply to requests it received (``nats micro``
    endpoints), whatever their reply subject.
    """

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False
    what: str = ""


PERMISSIONS: dict[str, Permissions] = {
    "gateway": Permissions(
        what="submits jobs (on tenant lanes too), writes job records (create, cancel) and "
             "tenant usage counts, reads the jobs/workers/leases buckets and JOB_EVENTS, "
             "reads consumer info and waiting jobs for queue metrics and positions",
        publish=(
            subjects.JOBS_SUBMIT, f"{subjects.JOBS_SUBMIT}.*.*",
            f"{subjects.JOB_EVENTS_PREFIX}.>",
            f"$KV.{subjects.BUCKET_JOBS}.>", f"$KV.{subjects.BUCKET_TENANT_USAGE}.>",
            *_common(),
            *_read(_KV[subjects.BUCKET_JOBS]), *_read(_KV[subjects.BUCKET_WORKERS]),
            *_read(_KV[subjects.BUCKET_LEASES]), *_read(_KV[subjects.BUCKET_TENANT_USAGE]),
            *_read(subjects.STREAM_JOB_EVENTS),
            # Queue depth (services/common/queue_metrics.py) and queue positions
            # (services/gateway/queue.py): information, not consumption.
            f"$JS.API.CONSUMER.LIST.{subjects.STREAM_VERIFY}",
            f"$JS.API.CONSUMER.LIST.{subjects.STREAM_JOBS}",
            f"$JS.API.CONSUMER.INFO.{subjects.STREAM_JOBS}.*",
            f"$JS.API.STREAM.MSG.GET.{subjects.STREAM_JOBS}",
        ),
        subscribe=("_INBOX.>",),
    ),
    "generator": Permissions(
        what="pulls jobs.submit, writes job records, publishes verify requests and job "
             "events, reads results, the workers bucket and its artifact store",
        publish=(
            f"{subjects.VERIFY_PREFIX}.>", f"{subjects.JOB_EVENTS_PREFIX}.>",
            f"{subjects.DLQ_PREFIX}.>", f"$KV.{subjects.BUCKET_JOBS}.>",
            f"$O.{subjects.OBJECT_STORE_ARTIFACTS}.>",
            # RemoteWorker.status (the SDK acts with a generator's rights).
            f"{subjects.WORKER_SERVICE_PREFIX}.*.status",
            *_common(),
            # ``generator`` and the lanes' ``generator-<tenant>-<priority>``.
            *_consume(subjects.STREAM_JOBS, "*"),
            # Messages on a lane no consumer takes go to the DLQ (LanePull.sweep_strays).
            *_sweep(subjects.STREAM_JOBS),
            *_read(subjects.STREAM_RESULTS), *_read(_KV[subjects.BUCKET_JOBS]),
            *_read(_KV[subjects.BUCKET_WORKERS]), *_read(_OBJ),
            # Replacing an object purges its old chunks.
            f"$JS.API.STREAM.PURGE.{_OBJ}",
        ),
        # The lanes' subjects wake an idle generator (services/common/lanes.py).
        subscribe=("_INBOX.>", subjects.JOBS_SUBMIT, f"{subjects.JOBS_SUBMIT}.*.*"),
    ),
    "worker": Permissions(
        what="pulls verify.<backend>.<arch>, publishes results and job events, writes "
             "the workers and leases buckets and the shared cache of baselines, "
             "reads job records, answers nats micro",
        publish=(
            f"{subjects.RESULTS_PREFIX}.>", f"{subjects.JOB_EVENTS_PREFIX}.>",
            f"{subjects.DLQ_PREFIX}.>", f"$KV.{subjects.BUCKET_WORKERS}.>",
            f"$KV.{subjects.BUCKET_LEASES}.>",
            *_common(),
            *_consume(subjects.STREAM_VERIFY, "*"),
            *_sweep(subjects.STREAM_VERIFY),
            *_read(_KV[subjects.BUCKET_JOBS]), *_read(_KV[subjects.BUCKET_WORKERS]),
            *_read(_KV[subjects.BUCKET_LEASES]),
            # The shared cache: created by the first worker, written and read by all.
            f"$JS.API.STREAM.CREATE.{_KV_BASELINES}",
            f"$KV.{subjects.BUCKET_BASELINES}.>", *_read(_KV_BASELINES),
        ),
        subscribe=("_INBOX.>", "$SRV.>", f"{subjects.WORKER_SERVICE_PREFIX}.>",
                   # Verify lanes' subjects wake an idle worker (services/common/lanes.py).
                   f"{subjects.VERIFY_PREFIX}.>"),
        allow_responses=True,
    ),
}


def _list(items: Iterable[str], indent: str) -> str:
    """A configuration list, one quoted subject a line (quoted: ``$JS...`` unquoted would
    be a variable reference)."""
    return "[\n" + "".join(f'{indent}  "{s}"\n' for s in items) + f"{indent}]"


def _secret(value: str) -> str:
    """A password in the configuration: ``$VAR`` stays a variable reference (resolved
    by nats-server from its environment), anything else becomes a quoted string."""
    if value.startswith("$"):
        return value
    if '"' in value or "\\" in value or "\n" in value:
        raise ValueError("a NATS password must not contain quotes, backslashes or newlines")
    return f'"{value}"'


def authorization_block(passwords: Mapping[str, str]) -> str:
    """nats-server configuration: an ``authorization`` block with one user per role
    of :data:`PERMISSIONS` and the ``admin`` user (no restriction).

    Args:
        passwords: user name (``admin``, ``gateway``, ``generator``, ``worker``) ->
            password, or ``$VARIABLE`` for nats-server to read from its environment.

    Raises:
        KeyError: a user has no password.
    """
    lines = ["# Generated by services/common/nats_auth.py (python -m services.common.nats_auth);",
             "# edit PERMISSIONS there, not this block.",
             "authorization {", "  users = ["]
    lines.append(f"    # {ADMIN_USER}: the operator (nats CLI): every subject.")
    lines.append(f'    {{user: "{ADMIN_USER}", password: {_secret(passwords[ADMIN_USER])}}}')
    for role, perms in PERMISSIONS.items():
        lines.append(f"    # {role}: {perms.what}.")
        lines.append(f'    {{user: "{role}", password: {_secret(passwords[role])}, permissions: {{')
        lines.append(f"      publish: {{allow: {_list(perms.publish, '      ')}}}")
        lines.append(f"      subscribe: {{allow: {_list(perms.subscribe, '      ')}}}")
        if perms.allow_responses:
            lines.append("      allow_responses: true")
        lines.append("    }}")
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def deploy_auth_conf() -> str:
    """``deploy/nats/auth.conf``: :func:`authorization_block` with each password read
    from the node's environment (``AIKG_NATS_<USER>_PASSWORD``, from ``deploy/.env``)."""
    users = (ADMIN_USER, *ROLES)
    return authorization_block({u: f"$AIKG_NATS_{u.upper()}_PASSWORD" for u in users})


@dataclass
class BusCredentials:
    """Per-run user names and random passwords for the admin and each service.

    Attributes:
        passwords: user name -> password (``secrets.token_urlsafe(24)``: 192 bits).
    """

    passwords: dict[str, str] = field(default_factory=lambda: {
        u: secrets.token_urlsafe(24) for u in (ADMIN_USER, *ROLES)})

    def service_env(self, role: str) -> dict[str, str]:
        """``AIKG_NATS_USER`` / ``AIKG_NATS_PASSWORD`` of one service."""
        return {"AIKG_NATS_USER": role, "AIKG_NATS_PASSWORD": self.passwords[role]}

    def role_settings(self) -> dict[str, str]:
        """Settings overrides naming every service's credentials
        (``nats_<role>_user`` / ``nats_<role>_password``), for one process that runs
        several services; the plain ``nats_user`` / ``nats_password`` are the admin's."""
        out = {"nats_user": ADMIN_USER, "nats_password": self.passwords[ADMIN_USER]}
        for role in ROLES:
            out[f"nats_{role}_user"] = role
            out[f"nats_{role}_password"] = self.passwords[role]
        return out

    def write_server_config(self, path: Path, *, base: str = "") -> Path:
        """Write a nats-server configuration (``base`` lines, then the authorization
        block) readable by its owner only (mode 0600)."""
        write_private(path, base + authorization_block(self.passwords))
        return path

    def write_admin_env(self, path: Path, url: str) -> Path:
        """Write the admin's ``NATS_URL`` / ``NATS_USER`` / ``NATS_PASSWORD`` (the
        variables the ``nats`` CLI reads) as a shell file, mode 0600."""
        write_private(path, f"NATS_URL={url}\nNATS_USER={ADMIN_USER}\n"
                            f"NATS_PASSWORD={self.passwords[ADMIN_USER]}\n")
        return path


def write_private(path: Path, text: str) -> None:
    """Create (or replace) ``path`` with mode 0600 before any byte is written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)
        f.write(text)


if __name__ == "__main__":
    sys.stdout.write(deploy_auth_conf())
