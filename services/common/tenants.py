"""Tenants: who submits a job, found by its API token, and the limits each may use.

A tenant is a name (1 to 32 letters, digits or ``_``) with an API token and limits.
Tenants come from a TOML file named by ``AIKG_TENANTS_FILE``; ``AIKG_API_TOKEN``, when
set, is the token of the tenant ``default`` (today's single-token setup keeps
working). Limits not given for a tenant take the ``AIKG_TENANT_*`` settings. The file
holds only the SHA-256 of each token (hex), never the token::

    [tenants.team_a]
    token_sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    max_in_flight = 30        # jobs pending or running at once; 0: no limit
    max_jobs_per_hour = 500   # submissions per clock hour (UTC); 0: no limit
    max_parallel_num = 8      # largest parallel_num of one job; 0: no limit
    max_rounds = 20           # largest max_rounds of one job; 0: no limit
    max_priority = "normal"   # highest priority it may ask for (low | normal | high)
    max_timeout_s = 600       # largest timeout_s of one job, seconds; 0: no limit
    max_generator_share = 0.75 # of a generator's job and lowering slots held at once
    max_device_share = 0.5    # of a backend/arch's devices held at once

``python -m services.common.tenants < token.txt`` prints a token's SHA-256 for the file.
The gateway, every generator and every worker read the same file: the gateway for
tokens and limits, the generators and workers for the shares they schedule by and
to refuse work of a tenant the file does not name (:meth:`TenantTable.refusal`). A
generator or worker without a file warns at start (:func:`warn_without_tenants_file`).

A token is compared by its SHA-256 against every tenant's, each comparison with
:func:`hmac.compare_digest` (Python's documented defence against timing attacks) and
none skipped, so the time taken does not depend on which tenant, if any, matched.
"""

from __future__ import annotations

import hashlib
import hmac
import sys
import threading
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from schemas import subjects
from services.common.settings import Settings

# Prometheus labels: each distinct value is a time series, so a process labels at most
# this many tenants by name and the rest as "other" (Prometheus' advice on label
# cardinality: https://prometheus.io/docs/practices/naming/#labels).
MAX_TENANT_LABELS = 50
OTHER_TENANT = "other"
_labels: set[str] = set()
_labels_lock = threading.Lock()

_LIMIT_KEYS = ("max_in_flight", "max_jobs_per_hour", "max_parallel_num", "max_rounds")
# Limits that are numbers of seconds (0: no limit) and fractions in (0, 1] (1: no cap).
_SECONDS_KEYS = ("max_timeout_s",)
_SHARE_KEYS = ("max_generator_share", "max_device_share")
_KNOWN_KEYS = ("token_sha256", "max_priority", *_LIMIT_KEYS, *_SECONDS_KEYS, *_SHARE_KEYS)


def tenant_label(name: str) -> str:
    """The metric label of tenant ``name``: the name for the first
    :data:`MAX_TENANT_LABELS` tenants a process sees, ``other`` after."""
    with _labels_lock:
        if name in _labels:
            return name
        if len(_labels) < MAX_TENANT_LABELS:
            _labels.add(name)
            return name
    return OTHER_TENANT


def hash_token(token: str) -> str:
    """SHA-256 of an API token, lower-case hex (64 characters): what the tenants file
    stores."""
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()


@dataclass(frozen=True)
class Tenant:
    """One tenant and its limits (0 means no limit), each given: a tenants file's entry
    over the ``AIKG_TENANT_*`` settings (:func:`load_tenants`).

    Attributes:
        name: the tenant's name (:data:`schemas.subjects.TENANT_PATTERN`).
        token_sha256: SHA-256 of its API token, hex; empty for the default tenant of a
            gateway without auth.
        max_in_flight: jobs pending or running at once.
        max_jobs_per_hour: submissions per clock hour (UTC).
        max_parallel_num / max_rounds: largest ``parallel_num`` / ``max_rounds`` of one job.
        max_priority: highest ``priority`` it may submit with.
        max_timeout_s: largest ``timeout_s`` of one job, seconds.
        max_generator_share: fraction of one generator's job slots and lowering slots
            (``generator_concurrency``) its jobs may hold at once; at least one slot
            (services/common/shares.py).
        max_device_share: fraction of a backend/arch's devices (all live workers') its
            verify requests may hold at once; at least one device (beyond it only
            while nobody else waits, with ``share_borrow_idle``).
    """

    name: str
    token_sha256: str
    max_in_flight: int
    max_jobs_per_hour: int
    max_parallel_num: int
    max_rounds: int
    max_priority: str
    max_timeout_s: float
    max_generator_share: float
    max_device_share: float

    def allows_priority(self, priority: str) -> bool:
        """Whether ``priority`` is at or below :attr:`max_priority`."""
        order = subjects.PRIORITIES
        return order.index(priority) >= order.index(self.max_priority)


@dataclass
class TenantTable:
    """The tenants of a deployment. ``auth`` False: no token is asked for and every
    request is the ``default`` tenant's. ``file``: the tenants file they were read
    from (empty: none)."""

    tenants: dict[str, Tenant] = field(default_factory=dict)
    auth: bool = False
    file: str = ""
    _digests: list[tuple[bytes, Tenant]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._digests = [(bytes.fromhex(t.token_sha256), t) for t in self.tenants.values()
                         if t.token_sha256]

    def authenticate(self, authorization: str) -> Tenant | None:
        """The tenant whose token an ``Authorization: Bearer <token>`` value carries.

        Every tenant's digest is compared (no early exit), each with
        :func:`hmac.compare_digest`; a missing or malformed header is hashed and
        compared like a wrong token.

        Returns:
            The tenant, or None when the token is nobody's. Without auth: ``default``.
        """
        if not self.auth:
            return self.tenants[subjects.DEFAULT_TENANT]
        scheme, _, token = authorization.partition(" ")
        digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        # The scheme as the gateway always wanted it: exactly ``Bearer``.
        bearer = hmac.compare_digest(scheme.encode("utf-8", "surrogateescape"), b"Bearer")
        found = None
        for expected, tenant in self._digests:
            if hmac.compare_digest(digest, expected) and bearer:
                found = tenant
        return found

    def get(self, name: str) -> Tenant:
        """Tenant ``name``'s entry (the ``default`` limits for a name not listed)."""
        return self.tenants.get(name) or self.tenants[subjects.DEFAULT_TENANT]

    def refusal(self, name: str, service: str) -> str | None:
        """Why ``service`` (``generator``, ``worker``) must refuse work of tenant
        ``name``: a tenants file is configured and does not name it. None when the
        tenant is listed (``default`` always is) or no file is configured (every
        tenant then has the default limits)."""
        if not self.file or name in self.tenants:
            return None
        return (f"tenant {name!r} is not in the tenants file {self.file} "
                f"(AIKG_TENANTS_FILE), so this {service} refuses its work: add "
                f"[tenants.{name}] to that file, which the gateway, every generator and "
                "every worker read, or submit as a tenant it lists")


def _defaults(settings: Settings) -> dict[str, object]:
    """Every limit's value for a tenant whose entry does not give it: setting
    ``tenant_<limit>``."""
    return {key: getattr(settings, f"tenant_{key}")
            for key in (*_LIMIT_KEYS, "max_priority", *_SECONDS_KEYS, *_SHARE_KEYS)}


def _check_limits(where: str, values: dict[str, object]) -> None:
    for key in _LIMIT_KEYS:
        value = values.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{where}: {key} = {value!r} must be a whole number >= 0 "
                             "(0: no limit)")
    for key in _SECONDS_KEYS:
        value = values.get(key)
        if not isinstance(value, int | float) or isinstance(value, bool) or not value >= 0:
            raise ValueError(f"{where}: {key} = {value!r} must be a number of seconds >= 0 "
                             "(0: no limit)")
    for key in _SHARE_KEYS:
        value = values.get(key)
        if not isinstance(value, int | float) or isinstance(value, bool) \
                or not 0 < value <= 1:
            raise ValueError(f"{where}: {key} = {value!r} must be a fraction in (0, 1] "
                             "(1: no cap; a tenant always gets at least one slot)")
    if values.get("max_priority") not in subjects.PRIORITIES:
        raise ValueError(f"{where}: max_priority = {values.get('max_priority')!r} must be one "
                         f"of {', '.join(subjects.PRIORITIES)}")


def load_tenants(settings: Settings) -> TenantTable:
    """Tenants from ``settings.tenants_file`` and ``settings.api_token``.

    Args:
        settings: ``tenants_file`` (TOML, format in the module docstring),
            ``api_token`` (the ``default`` tenant's token) and the ``tenant_max_*``
            defaults.

    Returns:
        A table; auth is on when either a file or a token is given. The ``default``
        tenant is always in it (with no token when neither names one).

    Raises:
        ValueError: the file cannot be read or parsed, names a tenant badly, has an
            unknown key, a token hash that is not 64 hex digits, a hash used twice, a
            bad limit, or gives the ``default`` tenant a hash while ``AIKG_API_TOKEN``
            is set; the message names the file and the entry.
    """
    defaults = _defaults(settings)
    _check_limits("AIKG_TENANT_* settings", defaults)
    entries: dict[str, dict[str, object]] = {}
    path = settings.tenants_file
    if path:
        try:
            doc = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ValueError(f"AIKG_TENANTS_FILE={path!r} cannot be read: {exc.strerror or exc}"
                             ) from exc
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"AIKG_TENANTS_FILE={path!r} is not valid TOML: {exc}") from exc
        table = doc.get("tenants")
        if not isinstance(table, dict) or set(doc) - {"tenants"}:
            raise ValueError(f"{path}: expected only [tenants.<name>] tables, e.g. "
                             "[tenants.team_a] with token_sha256 = \"<64 hex digits>\"")
        for name, entry in table.items():
            where = f"{path}: [tenants.{name}]"
            try:
                subjects.tenant_name(name)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
            if not isinstance(entry, dict):
                raise ValueError(f"{where} must be a table")
            unknown = set(entry) - set(_KNOWN_KEYS)
            if unknown:
                raise ValueError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; "
                                 f"known: {', '.join(_KNOWN_KEYS)}")
            token_hash = str(entry.get("token_sha256", "")).lower()
            if token_hash and (len(token_hash) != 64
                               or any(c not in "0123456789abcdef" for c in token_hash)):
                raise ValueError(f"{where}: token_sha256 must be 64 hex digits (the SHA-256 "
                                 "of the token: python -m services.common.tenants < token.txt)")
            values = {**defaults, **{k: v for k, v in entry.items() if k != "token_sha256"}}
            _check_limits(where, values)
            entries[name] = {**values, "token_sha256": token_hash}
    # Without a tenants file there are no tenants to share between (every name gets the
    # default tenant's entry): shares are whole, since a cap would leave devices and
    # slots idle for nobody.
    alone = {} if path else {key: 1.0 for key in _SHARE_KEYS}
    default = entries.setdefault(subjects.DEFAULT_TENANT,
                                 {**defaults, **alone, "token_sha256": ""})
    if settings.api_token:
        if default["token_sha256"]:
            raise ValueError(f"{path}: [tenants.default] has a token_sha256 and AIKG_API_TOKEN "
                             "is set too: keep one of them")
        default["token_sha256"] = hash_token(settings.api_token)
    seen: dict[str, str] = {}
    for name, values in entries.items():
        digest = str(values["token_sha256"])
        if digest and digest in seen:
            raise ValueError(f"tenants {seen[digest]!r} and {name!r} have the same token: give "
                             "each tenant its own")
        seen[digest] = name
    tenants = {name: Tenant(name=name, **values) for name, values in entries.items()}  # type: ignore[arg-type]
    return TenantTable(tenants=tenants, auth=bool(path or settings.api_token), file=path)


def warn_without_tenants_file(settings: Settings, service: str, logger) -> bool:
    """Log one warning (``tenants_file_unset``) when ``settings`` names no tenants
    file: ``service`` (``generator``, ``worker``) schedules by tenant, and without the
    file every tenant gets the ``AIKG_TENANT_MAX_*_SHARE`` defaults and work of any
    tenant name is accepted, whatever the gateway's file says. Returns whether it
    warned."""
    if settings.tenants_file:
        return False
    logger.warning(
        "tenants_file_unset", service=service, setting="AIKG_TENANTS_FILE",
        consequence=("no tenants to share between: every tenant's work is served, with "
                     "whole shares (the AIKG_TENANT_MAX_*_SHARE caps apply only to tenants "
                     "of a file), whatever the gateway's file says"),
        hint="set AIKG_TENANTS_FILE to the gateway's tenants file on every generator and "
             "worker")
    return True


def main(argv: list[str] | None = None) -> int:
    """``python -m services.common.tenants``: print the SHA-256 of a token read from
    standard input (not from the command line, where shell history and ``ps`` would
    keep it), for a tenants file's ``token_sha256``."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m services.common.tenants",
        description="Print the SHA-256 of the API token read from standard input (one "
                    "line), for the tenants file's token_sha256. Example: "
                    "`python -m services.common.tenants < token.txt`, or type it and press "
                    "Enter.")
    parser.parse_args(argv)
    token = sys.stdin.readline().strip()
    if not token:
        print("no token on standard input: pipe it in, e.g. "
              "`python -m services.common.tenants < token.txt`", file=sys.stderr)
        return 2
    print(hash_token(token))
    return 0


if __name__ == "__main__":
    sys.exit(main())
