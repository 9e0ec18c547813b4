"""Who may do what on the bus: one NATS user per service, with least privilege.

Each service connects as its own user (``gateway``, ``generator``, and one user per
worker, ``worker-<worker_id>``); the server refuses anonymous clients, and a further
user, ``admin``, has every right (the ``nats`` CLI of an operator, and the consumer
provisioner ``aikg nats-setup``). :data:`PERMISSIONS` and :func:`worker_permissions`
are the one source of each service's rights: :func:`authorization_block` renders them
into nats-server's configuration syntax for ``aikg up``'s embedded server, the tests'
servers and ``deploy/nats/auth.conf`` (regenerate that with ``python -m
services.common.nats_auth [--worker ID ...]``; ``tests/unit/test_deploy_files.py`` checks
that it matches).

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
  to a key is publish access to ``$KV.<bucket>.<key>``;
- ``$JS.API.STREAM.MSG.GET.<stream>`` (JSON-wrapped reply) / ``$JS.API.DIRECT.GET.<stream>.>``
  (raw reply): read a key; ``$JS.API.STREAM.INFO.<stream>`` with a subjects filter
  lists the keys; a watch is a consumer on ``KV_<bucket>``;
- ``$O.<store>.>``: object store chunks and metadata;
- ``<inbox prefix>.>``: replies to the client's requests (JetStream API answers,
  PubAcks, pulled messages) and its push consumers' deliveries; ``$SRV.>``: ``nats
  micro`` discovery.

Private replies. Each user subscribes only to its own inbox prefix, ``_INBOX_<user>``
(:func:`inbox_prefix`; nats-py's ``inbox_prefix``, which its request, JetStream,
pull, key-value watch and object store replies all use), and nobody but the admin to
``_INBOX.>``: the gateway's user cannot read the job submissions and verify requests a
generator pulls, nor one worker the reference-cache reads of another.

Consumers. No service may create, update or delete any consumer, in any API form
(``CONSUMER.CREATE.<stream>[.<name>[.<filter>]]``, ``CONSUMER.DURABLE.CREATE``,
``CONSUMER.DELETE``), nor use ``DIRECT.GET`` or answer flow control (``$JS.FC``):

- a create of an existing consumer is an update (the request body's ``action``, which
  no subject permission sees), so the right to create a shared durable would be the
  right to rewrite it;
- nats-server does not check a push consumer's ``deliver_subject`` against its
  creator's publish rights (https://github.com/nats-io/nats-server/issues/8274), so
  any create right let a user have stream messages delivered onto any subject: a
  worker's ``drain`` endpoint, a result subject, a bucket's key;
- nor is the reply subject of a JetStream API request checked: a ``DIRECT.GET``
  (or a pull, ``MSG.NEXT``) answers with the raw stored message on whatever reply
  subject the asker gives, and a stream listening there stores that copy (a key of
  another bucket rewritten with bytes of the asker's choosing).

So services read streams with ``STREAM.MSG.GET`` only (its reply is a JSON envelope,
which decodes as no record), list keys with ``STREAM.INFO`` and a subjects filter,
and pull only from the durables the admin-side provisioner makes
(services/common/provision.py), of streams whose content the puller cannot write.
What stays: any user with any JetStream API right can have the server write a
JSON-wrapped API reply onto any subject, which can spoil a record but not forge one
(readers skip what does not decode, and key listings skip copies with relay headers,
:func:`services.common.bus.bucket_entries`); docs/security.md.

Workers' keys. A worker writes only its own heartbeat, ``$KV.workers.<worker_id>``, and
its own leases, ``$KV.leases.<worker_id>.>``, and answers only its own control subjects
``aikg.worker.<worker_id>.>``: nats-server's permission templates (``{{name()}}``) exist
only for JWT users, so the configuration lists one user per worker id.

Nothing here lets a worker write the ``jobs`` bucket, a generator publish a verdict on
``results.>``, or the gateway consume ``verify.>``; nor anyone but a worker write (or
read) the workers' shared cache of baselines (bucket ``baselines``: eager and
``torch.compile`` timings), whose entries
a verdict's speedup is computed against. No service may update or delete a
stream: each may create the AIKG streams and buckets that are missing (so services
start in any order on an empty server), but changing an existing stream's
configuration takes the ``admin`` user.
"""

from __future__ import annotations

import argparse
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
# The workers of deploy/docker-compose.yml (their AIKG_WORKER_ID), each with its own user.
DEPLOY_WORKERS = ("cpu", "cuda")

_KV = {b: f"KV_{b}" for b in (subjects.BUCKET_JOBS, subjects.BUCKET_WORKERS,
                               subjects.BUCKET_LEASES, subjects.BUCKET_TENANT_USAGE,
                               subjects.BUCKET_BATCHES)}
_OBJ = f"OBJ_{subjects.OBJECT_STORE_ARTIFACTS}"
# The workers' shared cache of baselines, eager and torch.compile
# (services/worker/cache.py): they decide speedups, so only the worker user may create,
# write or read it.
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
    """Read single messages of ``stream``: ``STREAM.MSG.GET`` (by sequence, by subject,
    the last of a subject), whose reply is JSON-wrapped. No consumer of any kind (a
    push consumer delivers wherever its creator says, unchecked: nats-server issue
    #8274) and no ``DIRECT.GET`` (its raw reply goes to any reply subject the asker
    names, unchecked, and a stream listening there stores it)."""
    return [f"$JS.API.STREAM.MSG.GET.{stream}"]


def _pull(stream: str) -> list[str]:
    """Look up and pull from the durable consumers of ``stream`` (made by the
    provisioner: no create, update or delete), and ask the provisioner for a missing one.

    A pull (``MSG.NEXT``) delivers the raw message to the request's reply subject,
    which nats-server does not check against the puller's rights: only a stream whose
    content the puller cannot write may be pulled (JOBS by the generator, VERIFY by the
    workers), and the workers' control endpoints ignore such deliveries."""
    return [f"$JS.API.CONSUMER.INFO.{stream}.*", f"$JS.API.CONSUMER.MSG.NEXT.{stream}.*",
            f"$JS.ACK.{stream}.>", subjects.PROVISION_CONSUMER]


def inbox_prefix(user: str) -> str:
    """The inbox prefix of ``user``'s replies, ``_INBOX_<user>``: the only inbox subjects
    it may subscribe to (``_INBOX_<user>.>``)."""
    return f"_INBOX_{user}"


def worker_user(worker_id: str) -> str:
    """The NATS user of the worker ``worker_id``: ``worker-<worker_id>``.

    Raises:
        ValueError: ``worker_id`` is not one subject token (letters, digits, ``_``, ``-``).
    """
    return f"worker-{subjects.worker_service(worker_id).rsplit('.', 1)[1]}"


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
             "reads consumer info and waiting jobs for queue metrics and positions; "
             "publishes batch verify requests, writes batch records, reads their results "
             "and deletes a cancelled batch's requests no worker was given yet",
        publish=(
            subjects.JOBS_SUBMIT, f"{subjects.JOBS_SUBMIT}.*.*",
            # Batch verification (services/gateway/batches.py): its requests, its
            # record, its verdicts, and a cancelled batch's requests taken back.
            f"{subjects.VERIFY_PREFIX}.>", f"$KV.{subjects.BUCKET_BATCHES}.>",
            *_read(_KV[subjects.BUCKET_BATCHES]), *_read(subjects.STREAM_RESULTS),
            f"$JS.API.STREAM.MSG.DELETE.{subjects.STREAM_VERIFY}",
            f"$JS.API.CONSUMER.INFO.{subjects.STREAM_VERIFY}.*",
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
        # A job's events subject wakes its SSE stream (services/gateway/events.py), which
        # reads the events themselves with message gets.
        subscribe=(f"{inbox_prefix('gateway')}.>", f"{subjects.JOB_EVENTS_PREFIX}.>"),
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
            *_pull(subjects.STREAM_JOBS),
            # Messages on a lane no consumer takes go to the DLQ (LanePull.sweep_strays).
            *_sweep(subjects.STREAM_JOBS),
            *_read(subjects.STREAM_RESULTS), *_read(_KV[subjects.BUCKET_JOBS]),
            *_read(_KV[subjects.BUCKET_WORKERS]), *_read(_OBJ),
            # Replacing an object purges its old chunks.
            f"$JS.API.STREAM.PURGE.{_OBJ}",
        ),
        # The lanes' subjects wake an idle generator (services/common/lanes.py).
        # A job's results subjects wake its verdict waiter (services/common/verdicts.py),
        # which reads the verdicts themselves with message gets.
        subscribe=(f"{inbox_prefix('generator')}.>", subjects.JOBS_SUBMIT,
                   f"{subjects.JOBS_SUBMIT}.*.*", f"{subjects.RESULTS_PREFIX}.>"),
    ),
}


def worker_permissions(worker_id: str) -> Permissions:
    """The rights of the worker ``worker_id``'s user (:func:`worker_user`).

    Raises:
        ValueError: ``worker_id`` is not one subject token.
    """
    prefix = subjects.worker_service(worker_id)
    return Permissions(
        what=f"worker {worker_id}: pulls verify.<backend>.<arch>, publishes results and "
             "job events, writes its own heartbeat and leases and the shared cache of "
             "baselines, reads job records, answers nats micro on its own subjects",
        publish=(
            # Its own verdicts and claims only: the subject's last token names the
            # worker that sent a verdict (services/common/verdicts.py).
            f"{subjects.RESULTS_PREFIX}.*.{worker_id}",
            f"{subjects.RESULTS_PREFIX}.*.{worker_id}.claim",
            f"{subjects.JOB_EVENTS_PREFIX}.>", f"{subjects.DLQ_PREFIX}.>",
            # Its heartbeat key and its leases (``<worker_id>.<device>``) only.
            f"$KV.{subjects.BUCKET_WORKERS}.{worker_id}",
            f"$KV.{subjects.BUCKET_LEASES}.{worker_id}.>",
            *_common(),
            *_pull(subjects.STREAM_VERIFY),
            *_read(_KV[subjects.BUCKET_JOBS]), *_read(_KV[subjects.BUCKET_WORKERS]),
            *_read(_KV[subjects.BUCKET_LEASES]),
            # The shared cache: created by the first worker, written and read by all.
            f"$JS.API.STREAM.CREATE.{_KV_BASELINES}",
            f"$KV.{subjects.BUCKET_BASELINES}.>", *_read(_KV_BASELINES),
        ),
        subscribe=(f"{inbox_prefix(worker_user(worker_id))}.>", "$SRV.>", f"{prefix}.>",
                   # The headers-only copies of stored verify requests wake an idle
                   # worker (services/common/lanes.py); the requests' bodies, with their
                   # claim nonces, reach only the worker they are delivered to.
                   f"{subjects.WAKE_PREFIX}.{subjects.VERIFY_PREFIX}.>"),
        allow_responses=True,
    )


def user_permissions(worker_ids: Iterable[str]) -> dict[str, Permissions]:
    """Every service user's rights: the gateway's, the generator's and one
    ``worker-<id>`` per worker id, by user name.

    Raises:
        ValueError: a worker id is not one subject token, or is listed twice.
    """
    ids = list(worker_ids)
    if len(set(ids)) != len(ids):
        raise ValueError(f"worker ids listed twice: {ids}")
    return {**PERMISSIONS, **{worker_user(w): worker_permissions(w) for w in ids}}


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


def authorization_block(passwords: Mapping[str, str], worker_ids: Iterable[str]) -> str:
    """nats-server configuration: an ``authorization`` block with the ``admin`` user (no
    restriction) and one user per entry of :func:`user_permissions`.

    Args:
        passwords: user name (``admin``, ``gateway``, ``generator``, ``worker-<id>``) ->
            password, or ``$VARIABLE`` for nats-server to read from its environment.
        worker_ids: the workers that get a user.

    Raises:
        KeyError: a user has no password.
        ValueError: a bad worker id, or a password with quotes, backslashes or newlines.
    """
    lines = ["# Generated by services/common/nats_auth.py (python -m services.common.nats_auth);",
             "# edit the permissions there, not this block.",
             "authorization {", "  users = ["]
    lines.append(f"    # {ADMIN_USER}: the operator (nats CLI, aikg nats-setup): every subject.")
    lines.append(f'    {{user: "{ADMIN_USER}", password: {_secret(passwords[ADMIN_USER])}}}')
    for user, perms in user_permissions(worker_ids).items():
        lines.append(f"    # {user}: {perms.what}.")
        lines.append(f'    {{user: "{user}", password: {_secret(passwords[user])}, permissions: {{')
        lines.append(f"      publish: {{allow: {_list(perms.publish, '      ')}}}")
        lines.append(f"      subscribe: {{allow: {_list(perms.subscribe, '      ')}}}")
        if perms.allow_responses:
            lines.append("      allow_responses: true")
        lines.append("    }}")
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def password_variable(user: str) -> str:
    """The environment variable a deployed node reads ``user``'s password from:
    ``AIKG_NATS_<USER>_PASSWORD`` (upper case, ``-`` as ``_``)."""
    return f"AIKG_NATS_{user.upper().replace('-', '_')}_PASSWORD"


def deploy_auth_conf(worker_ids: Iterable[str] = DEPLOY_WORKERS) -> str:
    """``deploy/nats/auth.conf``: :func:`authorization_block` with each password read
    from the node's environment (:func:`password_variable`, from ``deploy/.env``)."""
    ids = list(worker_ids)
    users = (ADMIN_USER, *user_permissions(ids))
    return authorization_block({u: f"${password_variable(u)}" for u in users}, ids)


@dataclass
class BusCredentials:
    """Per-run user names and random passwords for the admin and each service.

    Args:
        worker_ids: the workers that get a user (``worker-<id>``); the first is the one
            :meth:`service_env` and :meth:`role_settings` name.

    Attributes:
        passwords: user name -> password (``secrets.token_urlsafe(24)``: 192 bits).

    Raises:
        ValueError: no worker id, a bad one, or one listed twice.
    """

    worker_ids: tuple[str, ...] = ("local",)
    passwords: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.worker_ids = tuple(self.worker_ids)
        if not self.worker_ids:
            raise ValueError("BusCredentials needs at least one worker id")
        for user in (ADMIN_USER, *user_permissions(self.worker_ids)):
            self.passwords.setdefault(user, secrets.token_urlsafe(24))

    def worker_settings(self, worker_id: str | None = None) -> dict[str, str]:
        """Settings overrides of one worker: ``worker_id`` and its user's
        ``nats_worker_user`` / ``nats_worker_password`` (the first worker by default).

        Raises:
            KeyError: ``worker_id`` has no user here.
        """
        worker_id = worker_id or self.worker_ids[0]
        user = worker_user(worker_id)
        return {"worker_id": worker_id, "nats_worker_user": user,
                "nats_worker_password": self.passwords[user]}

    def service_env(self, role: str) -> dict[str, str]:
        """``AIKG_NATS_USER`` / ``AIKG_NATS_PASSWORD`` of one service (``admin`` too);
        a worker's (the first worker id) with its ``AIKG_WORKER_ID``."""
        if role == "worker":
            own = self.worker_settings()
            return {"AIKG_NATS_USER": own["nats_worker_user"],
                    "AIKG_NATS_PASSWORD": own["nats_worker_password"],
                    "AIKG_WORKER_ID": own["worker_id"]}
        return {"AIKG_NATS_USER": role, "AIKG_NATS_PASSWORD": self.passwords[role]}

    def role_settings(self) -> dict[str, str]:
        """Settings overrides naming every service's credentials
        (``nats_<role>_user`` / ``nats_<role>_password``; the worker's are those of the
        first worker id, which ``worker_id`` names), for one process that runs several
        services; the plain ``nats_user`` / ``nats_password`` are the admin's."""
        out = {"nats_user": ADMIN_USER, "nats_password": self.passwords[ADMIN_USER]}
        for role in ROLES:
            if role != "worker":
                out[f"nats_{role}_user"] = role
                out[f"nats_{role}_password"] = self.passwords[role]
        return {**out, **self.worker_settings()}

    def write_server_config(self, path: Path, *, base: str = "") -> Path:
        """Write a nats-server configuration (``base`` lines, then the authorization
        block) readable by its owner only (mode 0600)."""
        write_private(path, base + authorization_block(self.passwords, self.worker_ids))
        return path

    def write_admin_env(self, path: Path, url: str) -> Path:
        """Write the admin's URL, user and password as a shell file, mode 0600, twice:
        as ``NATS_URL`` / ``NATS_USER`` / ``NATS_PASSWORD`` (what the ``nats`` CLI
        reads) and as ``AIKG_NATS_URL`` / ``AIKG_NATS_USER`` / ``AIKG_NATS_PASSWORD``
        (what AIKG's settings read: a worker-only client that sources the file)."""
        password = self.passwords[ADMIN_USER]
        write_private(path, "".join(
            f"{prefix}NATS_URL={url}\n{prefix}NATS_USER={ADMIN_USER}\n"
            f"{prefix}NATS_PASSWORD={password}\n" for prefix in ("", "AIKG_")))
        return path


def write_private(path: Path, text: str) -> None:
    """Create (or replace) ``path`` with mode 0600 before any byte is written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)
        f.write(text)


def main(argv: list[str] | None = None) -> int:
    """``python -m services.common.nats_auth [--worker ID ...]``: print
    ``deploy/nats/auth.conf`` for those workers (default: :data:`DEPLOY_WORKERS`)."""
    parser = argparse.ArgumentParser(
        prog="python -m services.common.nats_auth",
        description="Print the nats-server authorization block of deploy/nats/auth.conf: "
                    "admin, gateway, generator and one user per worker id, passwords "
                    "read from AIKG_NATS_<USER>_PASSWORD.")
    parser.add_argument("--worker", action="append", metavar="ID",
                        help="a worker id (its AIKG_WORKER_ID) that gets a user "
                             f"worker-<ID>; repeat for each (default: {' '.join(DEPLOY_WORKERS)})")
    args = parser.parse_args(argv)
    try:
        sys.stdout.write(deploy_auth_conf(args.worker or DEPLOY_WORKERS))
    except ValueError as exc:
        parser.error(str(exc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
