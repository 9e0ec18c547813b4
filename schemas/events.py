"""msgspec records for every event and API body AIKG exchanges.

Wire names are public (HTTP bodies, events and ``nats`` CLI users rely on them); for
job submission and status they are the HTTP AIKG server's (docs/compatibility.md). All payloads
are JSON (see :func:`encode` / :func:`decode`), so ``nats pub`` / ``nats sub`` /
``nats kv get`` read and write them directly. Every record carries a ``type`` tag and
a ``schema_version``; both have defaults, so a hand-written JSON body may omit them.

Constraints (``msgspec.Meta``) reject bad bodies at the edge; the error names the
field, e.g. ``Expected `int` >= 1 - at `$.max_rounds```.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta, Struct, field

from schemas.subjects import TOKEN_PATTERN

SCHEMA_VERSION = 1

# One NATS subject token: ids, backends and arches end up in subjects.
_TOKEN_PATTERN = TOKEN_PATTERN
Token = Annotated[str, Meta(pattern=_TOKEN_PATTERN, min_length=1, max_length=64)]
JobId = Annotated[str, Meta(pattern=_TOKEN_PATTERN, min_length=1, max_length=64,
                            description="Client-chosen or generated job id; also the submit message's Nats-Msg-Id")]
OpName = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")]
# A task or candidate is Python source; 1 MiB is far above any KernelBench file (the
# largest level-3 problems are a few KiB) and well below the NATS 8 MiB payload cap.
MAX_SOURCE_BYTES = 1 << 20
Source = Annotated[str, Meta(min_length=1, max_length=MAX_SOURCE_BYTES)]
# The name a candidate's file is shown under in a verdict's messages and tracebacks
# (``kernel.py line 30``): a file name without a directory, never a path the worker opens.
SOURCE_NAME_DEFAULT = "candidate.py"
SourceName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.+-]{0,63}$",
                                 description="The candidate's file name as the verdict "
                                             "shows it; a display name, never a path")]
# A shape override assigns one module-level name of the task: a size, a dim, a flag,
# a mode. Bounds: an int is an int32 (what a kernel's offsets and a dim hold; a
# negative one is a dim or an offset), a shape's extents are in [0, 2**31), a float is
# within +-2**31, a string at most 256 characters, a list of extents (a shape, or the
# layer widths of an MLP: KernelBench level 3's DeepNarrowMLP has 16) at most 256 long,
# at most 64 names. Anything larger is no size a device holds, and refusing it at the
# door keeps it from failing later in a generator or worker.
ShapeInt = Annotated[int, Meta(ge=-(2**31), lt=2**31)]
ShapeExtent = Annotated[int, Meta(ge=0, lt=2**31)]
ShapeValue = (ShapeInt | Annotated[float, Meta(ge=-2.0**31, le=2.0**31)] | bool
              | Annotated[str, Meta(max_length=256)]
              | Annotated[list[ShapeExtent], Meta(max_length=256)])
ShapeOverrides = Annotated[
    dict[Annotated[str, Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=128)], ShapeValue],
    Meta(max_length=64)]

Backend = Literal["cpu", "cuda", "ascend"]
Dsl = Literal["triton", "triton_cuda", "triton_ascend"]
Framework = Literal["torch"]
Workflow = Literal["coder_only_workflow", "default_workflow"]
JobType = Literal["single", "evolve"]
Coder = Literal["builtin", "llm"]
Priority = Literal["low", "normal", "high"]
TenantName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_]{1,32}$")]
JobStatus = Literal["pending", "running", "completed", "failed", "cancelled"]
TERMINAL_STATUSES: frozenset[str] = frozenset({"completed", "failed", "cancelled"})
VerifyMode = Literal["verify", "profile"]
# Where a candidate failed; None when it passed. Order follows the run: static checks,
# kernel compile, first call, wall-clock limit, numerical comparison, process death,
# and failures of the worker itself (not the candidate's fault); ``unchecked``: every
# check passed, but what the task's own sizes launch was not checked (a passed verdict
# accepted with ``allow_unchecked`` keeps it too).
Stage = Literal["static", "compile", "runtime", "timeout", "mismatch", "crash", "infrastructure",
                "audit", "task", "unchecked"]


def utcnow() -> dt.datetime:
    """Current time, timezone-aware UTC (encoded as RFC 3339 on the wire)."""
    return dt.datetime.now(dt.UTC)


def new_id(prefix: str = "") -> str:
    """A fresh 32-hex-digit id, optionally prefixed (``job-…``, ``req-…``)."""
    return f"{prefix}{uuid.uuid4().hex}"


def normalize_dsl(dsl: str) -> str:
    """Map the reference document's ``triton_cuda`` / ``triton_ascend`` to ``triton``."""
    return "triton" if dsl.startswith("triton") else dsl


class JobSubmit(Struct, kw_only=True, forbid_unknown_fields=True):
    """A job: generate a kernel for ``task_desc`` and verify it on ``backend``/``arch``.

    Sent as the HTTP body of ``POST /api/v1/jobs/submit`` or published raw on
    ``jobs.submit``. Field names are those of ``AIKGClient.submit_job`` in the
    reference document.
    """

    op_name: OpName
    task_desc: Source
    job_type: JobType = "single"
    backend: Backend = "cpu"
    # None: any arch of ``backend`` that has a live worker (chosen at submission).
    arch: Token | None = None
    dsl: Dsl = "triton"
    framework: Framework = "torch"
    workflow: Workflow = "coder_only_workflow"
    max_rounds: Annotated[int, Meta(ge=1, le=1000)] = 1
    parallel_num: Annotated[int, Meta(ge=1, le=256)] = 1
    num_islands: Annotated[int, Meta(ge=1, le=64)] = 1
    migration_interval: Annotated[int, Meta(ge=1, le=1000)] = 2
    elite_size: Annotated[int, Meta(ge=0, le=1000)] = 5
    parent_selection_prob: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.5
    init_code: Source | None = None
    shape_overrides: ShapeOverrides = field(default_factory=dict)
    # None: the LLM coder when one is configured, else the built-in coder.
    coder: Coder | None = None
    job_id: JobId | None = None
    # Attempts per single job (candidates, including repairs).
    max_attempts: Annotated[int, Meta(ge=1, le=100)] = 3
    # Wall-clock limit for one candidate's verification, seconds.
    timeout_s: Annotated[float, Meta(gt=0, le=3600)] = 300.0
    # Correctness trials per candidate, each with its own seed and fresh inputs.
    trials: Annotated[int, Meta(ge=1, le=20)] = 3
    # Accept a partial check of each candidate (VerifyRequest.allow_unchecked).
    allow_unchecked: bool = False
    # Order among this tenant's waiting jobs and against other tenants' (high lanes
    # are served first); a tenant may be limited to a lower one (docs/architecture.md).
    priority: Priority = "normal"
    type: Literal["job.submit"] = "job.submit"
    schema_version: int = SCHEMA_VERSION


class LLMUsage(Struct, kw_only=True):
    """LLM calls made for a job, summed over its agents (designer, coder, conductor).

    ``requests`` counts the HTTP calls behind the replies the job got (retries
    included); ``prompt_tokens`` / ``completion_tokens`` are what the endpoint
    reported in ``usage``; ``duration_s`` is the wall time of the answered calls,
    seconds.
    """

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    duration_s: float = 0.0


class CandidateRecord(Struct, kw_only=True):
    """One candidate of a job, as its record keeps it (``progress.candidates``).

    Written by compare-and-swap *before* its verify request is published, so a
    generator that takes the job over after a crash knows which requests exist and
    neither redoes nor loses one. ``request_id`` is deterministic per attempt (it is
    also the request's ``Nats-Msg-Id``). ``code`` is kept for the latest candidate
    only (the one a repair or a resume needs); earlier ones keep ``code_sha256``.
    ``verify_seq`` is the VERIFY stream sequence of the published request (None until
    the publish was acknowledged). ``passed`` / ``stage`` / ``error`` are the verdict,
    None while it is pending.
    """

    attempt: int
    candidate_id: str
    request_id: str
    coder: str
    code_sha256: str
    code: str | None = None
    guidance: str = ""
    verify_seq: int | None = None
    passed: bool | None = None
    stage: Stage | None = None
    error: str | None = None
    created_at: dt.datetime = field(default_factory=utcnow)


class JobProgress(Struct, kw_only=True):
    """How far a job has got; shown by ``aikg submit --wait`` and the status route.

    ``candidates`` lists every candidate in attempt order; ``plan`` is the designer's
    plan (``default_workflow``); ``llm_usage`` sums the job's LLM calls.
    """

    phase: str = "queued"
    message: str = ""
    candidates_generated: int = 0
    candidates_verified: int = 0
    candidates_passed: int = 0
    round: int = 0
    max_rounds: int = 1
    candidates: list[CandidateRecord] = field(default_factory=list)
    plan: str | None = None
    llm_usage: LLMUsage = field(default_factory=LLMUsage)


class VerifyRequest(Struct, kw_only=True):
    """Check one candidate against the task's reference on ``verify.<backend>.<arch>``.

    ``timeout_s`` is the wall-clock limit of the whole run in seconds; ``trials`` the
    number of seeds (fresh inputs each). The ``request_id`` is the message's
    ``Nats-Msg-Id``, so a republished request inside the dedupe window is dropped.
    ``allow_unchecked``: accept a partial check. By default a verdict passes only when
    what the task's own sizes launch was checked (else ``passed: false``, stage
    ``unchecked``); with it, such a verdict passes, keeps ``stage: "unchecked"`` and
    the ``unchecked`` list, and says so in ``notes``.

    ``source_name``: the candidate's file name as the verdict's messages and
    tracebacks show it (``kernel.py line 30``; default ``candidate.py``): letters,
    digits, ``_ . + -``, at most 64 characters, no directory. A display name only: the
    worker writes the candidate under its own name.

    ``claim_nonce``: a secret of the requester for this request (hex; from
    :func:`services.common.verdicts.claim_nonce`). Only the worker JetStream delivers
    the request to reads it; its claim and verdict carry a proof made from it
    (``VerifyClaim.proof``, ``VerifyResult.proof``), and the requester counts a
    verdict only with a proof of the worker that holds the request. Empty: the
    request was made by hand (``nats pub``) and no provenance can be checked.
    """

    request_id: Token
    job_id: JobId
    candidate_id: Token
    op_name: OpName
    task_desc: Source
    code: Source
    backend: Backend
    arch: Token
    dsl: Dsl = "triton"
    framework: Framework = "torch"
    mode: VerifyMode = "verify"
    shape_overrides: ShapeOverrides = field(default_factory=dict)
    timeout_s: Annotated[float, Meta(gt=0, le=3600)] = 300.0
    trials: Annotated[int, Meta(ge=1, le=20)] = 3
    allow_unchecked: bool = False
    source_name: SourceName = SOURCE_NAME_DEFAULT
    claim_nonce: str = ""
    created_at: dt.datetime = field(default_factory=utcnow)
    # The job's tenant and priority (also in the lane subject the request waits on).
    tenant: TenantName = "default"
    priority: Priority = "normal"
    type: Literal["verify.request"] = "verify.request"
    schema_version: int = SCHEMA_VERSION


# Phase names of VerifyResult.phases (seconds each), in the order they happen.
VERIFY_PHASES: dict[str, str] = {
    "queue": "from the request's store in the VERIFY stream (its JetStream timestamp) "
             "to its delivery to this worker",
    "fetch_to_start": "from delivery to the lease: decoding, the delivery count, "
                      "waiting for a free device",
    "lease": "putting the device lease in the leases bucket, and beside it the "
             "job-cancelled check",
    "static": "static checks of the candidate's source",
    "sandbox_start": "starting the fork server and probing the sandbox (a worker's "
                     "first request only, when it was not started before)",
    "reference_start": "forking the reference child, loading the task and measuring its "
                       "inputs until it sends the constructor arguments",
    "candidate_start": "forking the candidate's planner and replayer children, importing "
                       "the candidate and building ModelNew",
    "dry_run": "choosing the other sizes: dry runs of forward on meta tensors at the "
               "task's own sizes and the search for congruent ones, their references",
    "trials": "the trials: planning on decoys, replaying on the real inputs, comparing, "
              "up to the last trial's verdict",
    "checks": "the other sizes, the plan without launches, every autotune config, the "
              "GPU compile check and the candidate's audit, once the trials are done",
    "profile": "the timing runs (mode profile on a GPU): the reference's, the candidate's",
    "reference": "the reference child, start to end (makes every input and output)",
    "candidate": "the candidate's planner child, start to end",
    "replay": "the replayer child of the trials (the candidate's kernels on the real "
              "inputs), start to end",
    "replay_side": "the replayer child of the other sizes and the variants of the first "
                   "call, beside it, start to end",
    "verdict": "what is left: audits of the results, the timing floor, building the "
               "verdict",
    "publish": "publishing the result and acking the request (metrics only: the result "
               "cannot carry the time of its own publish)",
}
# Phases of children run beside the consecutive spans (they overlap them).
VERIFY_PHASES_BESIDE = ("reference", "candidate", "replay", "replay_side")


def phase_label(name: str) -> str:
    """The metric label of phase ``name``: ``trial_2`` -> ``trial`` (bounded label values)."""
    base, _, index = name.rpartition("_")
    return base if base and index.isdigit() else name


class VerifyPhase(Struct, kw_only=True, omit_defaults=True):
    """One phase of a verification starting or ending, reported as it happens (the
    same spans :class:`VerifyResult`'s ``phases`` times; services/worker/progress.py).

    ``name`` is a :data:`VERIFY_PHASES` name (``lowering`` for the built-in coder
    before a local ``aikg run``); ``step`` a finer step within it: ``trial`` (with
    ``trial``, 1-based, of ``trials``) in ``trials``, ``other sizes``, ``replays``
    (the first call's variants) and ``compile check`` in ``checks``. ``label`` is the
    phase in words (``trial 2 of 3``). ``state`` is ``started`` or ``ended``;
    ``seconds`` the length of the span an ``ended`` report closes; ``elapsed_s``
    seconds since the verification started. What the worker says it is doing, for a
    person to watch: nothing decides on it (a verdict is only the signed
    :class:`VerifyResult`).
    """

    name: str
    label: str
    state: Literal["started", "ended"] = "started"
    step: str = ""
    trial: int | None = None
    trials: int | None = None
    seconds: float | None = None
    elapsed_s: float = 0.0


class LaunchTraffic(Struct, kw_only=True, omit_defaults=True):
    """One launch of a call, counted by the worker's replayer
    (services/worker/traffic.py): ``kernel`` (a Triton kernel's name, or ``aten.<op>``
    for an operator of the plan that runs a kernel in eager PyTorch), bytes ``loaded``
    / ``stored`` / ``atomic`` (read-modify-write, counted once), ``dot_flops`` by the
    dot's input dtype (``tf32``, ``fp32`` (IEEE), ``fp16``, ``bf16``, ``fp8``),
    element-wise ``flops``. What the tile-aware time model reads (0 / empty: not
    known, e.g. an ``aten`` operator): ``programs`` (the grid's size), ``unique_loaded``
    (distinct bytes the launch's loads reached: ``loaded`` less re-reads), ``num_warps``
    and ``num_stages`` (the launch's options), ``dot_tile`` (``[M, N, K, element
    bytes]`` of its largest ``tl.dot``)."""

    kernel: str
    loaded: int = 0
    stored: int = 0
    atomic: int = 0
    dot_flops: dict[str, int] = field(default_factory=dict)
    flops: int = 0
    programs: int = 0
    unique_loaded: int = 0
    num_warps: int = 0
    num_stages: int = 0
    dot_tile: list[int] = field(default_factory=list)


class EagerCount(Struct, kw_only=True):
    """The task's eager ATen graph, counted in the reference child
    (services/worker/traffic.py, EagerCounter): ``bytes`` (each operator's tensor
    inputs and outputs), ``dot_flops`` by dtype (``torch.utils.flop_counter``'s
    matmul-family formulas), ``launches`` (operators that are not views)."""

    bytes: int = 0
    dot_flops: dict[str, int] = field(default_factory=dict)
    launches: int = 0


class Traffic(Struct, kw_only=True):
    """What a verdict reports (``VerifyResult.traffic``): the first trial's call,
    counted, and the model of it.

    ``bytes_moved``: every byte its launches loaded, stored or touched atomically;
    ``bytes_min``: each input and each captured storage a launch was given read once,
    each output written once; ``traffic_ratio``: ``bytes_moved / bytes_min``;
    ``flops``: ``tl.dot`` FLOPs (all dtypes) plus element-wise FLOPs; ``launches``;
    ``per_launch``: each launch's counts. ``model_arch``: the
    GPU target modeled (services/worker/targets.py); ``modeled_time_us`` of the
    candidate, ``modeled_eager_time_us`` of the task's eager ATen graph and
    ``modeled_speedup`` (their ratio) are a model, not a measurement (see
    docs/verification.md, "Counted traffic", for what it leaves out): the roofline
    (every byte from device memory); ``tile_time_us``, ``tile_eager_time_us`` and
    ``tile_speedup`` are the tile-aware model of the same counts (L2, occupancy, tile
    shape, spills), beside it; ``tile_dram_bytes``: the device-memory bytes the tile
    model charges."""

    counted_by: str = "interpreter"
    bytes_moved: int = 0
    bytes_min: int = 0
    traffic_ratio: float | None = None
    flops: int = 0
    dot_flops: dict[str, int] = field(default_factory=dict)
    launches: int = 0
    per_launch: list[LaunchTraffic] = field(default_factory=list)
    model_arch: str = ""
    modeled_time_us: float | None = None
    modeled_eager_time_us: float | None = None
    modeled_speedup: float | None = None
    tile_time_us: float | None = None
    tile_eager_time_us: float | None = None
    tile_speedup: float | None = None
    tile_dram_bytes: int | None = None


class ProfiledKernel(Struct, kw_only=True):
    """One kernel (or device copy) the profiler recorded in a candidate's timed calls
    (``VerifyResult.profiled_kernels``; ``torch.profiler`` over the timed repeats, on
    the device).

    ``name``: the kernel's name as the profiler gives it (a Triton kernel's is its
    function's name); ``count``: launches over all the timed calls (``calls`` of them);
    ``device_time_us``: its mean device time per launch, microseconds; ``kind``:
    ``triton`` (one of the candidate's Triton kernels), ``copy`` (a memcpy or memset),
    ``op`` (a kernel of an allowlisted ATen operator: a fill, a layout or dtype copy;
    ``op`` names it), ``forbidden`` (any other kernel: the verdict fails at ``audit``
    naming it). The harness's own L2-flush kernel is not listed.
    """

    name: str
    count: int
    calls: int
    kind: Literal["triton", "copy", "op", "forbidden"]
    device_time_us: float = 0.0
    op: str | None = None


class CompileFact(Struct, kw_only=True):
    """What the GPU compiler says of one kernel specialisation the compile check built
    (``VerifyResult.compile_facts``; read without a GPU: services/worker/gpu_facts.py).

    ``kernel``: the Triton function; ``target`` / ``arch``: the GPU
    (services/worker/targets.py: ``h100`` / ``sm_90``, ``mi300x`` / ``gfx942``);
    ``where``: the launch it was first compiled for (a trial, a size, an autotune
    config's number); ``config``: the specialisation's block sizes and options
    (``BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3``); ``registers``: per
    thread (NVIDIA's REG; AMD's VGPRs + AGPRs); ``spill_bytes``: per thread (NVIDIA's
    stack frame, where ptxas spills; AMD's scratch per lane), > 0 when registers
    spilled; ``shared_bytes``: shared memory (LDS) per block, bytes; ``num_warps``:
    warps (waves) per block; ``occupancy_warps``: resident warps per SM (waves per CU)
    that registers, shared memory and the arch's limits allow; ``max_warps``: the
    arch's limit of those; ``limiter``: what binds first (``registers``, ``shared``,
    ``warps``, ``blocks``); ``ok``: it compiled and a block fits; ``error``: why not.
    """

    kernel: str
    target: str
    arch: str
    where: str = ""
    config: str = ""
    registers: int = 0
    spill_bytes: int = 0
    shared_bytes: int = 0
    num_warps: int = 0
    occupancy_warps: int = 0
    max_warps: int = 0
    limiter: str = ""
    ok: bool = True
    error: str = ""


class VerifyResult(Struct, kw_only=True):
    """A worker's verdict on one candidate, published on ``results.<job_id>.<worker_id>``.

    Times are microseconds (``base_time_us`` the eager reference, ``gen_time_us`` the
    candidate); ``speedup`` is ``base_time_us / gen_time_us`` and is None when timings
    are not meaningful (``interpreted``: Triton ran in its CPU interpreter).
    ``duration_s`` is the worker's wall time for the whole verification, seconds.

    Stage ``audit``: the outputs matched, but a dynamic check found that the kernels
    did not compute them (PyTorch operators ran in ``forward``, the outputs do not
    depend on the Triton kernels), that the candidate interfered with the harness, or
    that a timing is impossible. ``rel_l2_error`` is the largest ``||got - expected|| /
    ||expected||`` over the outputs compared. ``sizes_checked`` lists the module-level
    sizes of each input size run (the requested shapes first); ``task_sizes_checked``
    says whether the task's own sizes were among them (None: not reached).
    ``ghost_replay`` says what the run with every Triton launch turned into a no-op
    showed, or why it was skipped. ``notes`` are facts about how the candidate was run
    (e.g. which autotune config the interpreter used).

    ``phases``: where the time went, seconds per phase, measured by the worker on its
    own monotonic clock (names and meanings: :data:`VERIFY_PHASES`). Phases outside
    :data:`VERIFY_PHASES_BESIDE` are consecutive spans of the verification and add up
    to ``duration_s`` (queue wait, fetch-to-start and lease precede it and are not
    part of it); the ones in it are children that ran beside those spans. Empty from
    a worker that does not measure them.

    ``reference_source``: where the reference outputs came from: ``run`` (a
    reference child ran now), ``worker_cache`` (this worker's process kept them) or
    ``shared_cache`` (the ``references`` object store every worker shares); None
    when the run stopped before (e.g. at static checks). ``baseline_source`` /
    ``baseline_age_s``: likewise for the eager baseline behind ``base_time_us``
    (``measured`` now, ``worker_cache``, ``shared_cache``: the ``baselines``
    bucket) and seconds since it was measured; None when nothing was timed.

    Profiled (``mode="profile"`` on a GPU): ``speedup_eager`` is ``base_time_us /
    gen_time_us`` (``speedup`` repeats it); ``compile_time_us`` the median time of the
    reference ``Model`` compiled with ``torch.compile`` (default mode), microseconds,
    timed the same way and cached like the eager baseline, and ``speedup_compile``
    ``compile_time_us / gen_time_us``: None, with a note, when ``torch.compile``
    failed or did not finish (the candidate's verdict never depends on it).
    ``peak_fraction``: the candidate's achieved bytes/s over the arch's peak memory
    bandwidth or its FLOP/s over the arch's dense peak, whichever is larger
    (``peak_bound`` says which: ``memory`` or ``compute``); the bytes are the task's
    minimum (each input and parameter read once, each output written once), the
    FLOPs the task's matrix-product FLOPs as ``torch.utils.flop_counter`` counts its
    eager graph (none counted: memory alone); peaks from services/worker/targets.py.
    ``launch_floor_us``: the time the same timing method gives a one-element fill
    kernel on the same device (a launch doing no work), microseconds: a
    ``gen_time_us`` near it is launch-bound. ``profiled_kernels``: what the profiler
    recorded in the candidate's timed calls (:class:`ProfiledKernel`); empty when
    nothing was profiled.

    ``compile_facts``: registers, spills, shared memory and occupancy of every kernel
    specialisation the GPU compile check compiled, per target (:class:`CompileFact`;
    the request's target and the compile check's extra targets, e.g. ``mi300x`` beside
    ``h100``); empty when the check did not run or nothing compiled.
    """

    request_id: str
    job_id: str
    candidate_id: str
    worker_id: str
    device: str
    passed: bool
    stage: Stage | None = None
    error: str | None = None
    log: str = ""
    max_abs_error: float | None = None
    max_rel_error: float | None = None
    mismatch_count: int | None = None
    mismatch_indices: list[list[int]] = field(default_factory=list)
    atol: float | None = None
    rtol: float | None = None
    trials: int = 0
    base_time_us: float | None = None
    gen_time_us: float | None = None
    speedup: float | None = None
    interpreted: bool = False
    duration_s: float = 0.0
    rel_l2_error: float | None = None
    sizes_checked: list[dict[str, int | list[int]]] = field(default_factory=list)
    task_sizes_checked: bool | None = None
    ghost_replay: str | None = None
    shape_generic: bool | None = None
    shape_generic_sizes: dict[str, int | list[int]] = field(default_factory=dict)
    unchecked: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)
    reference_source: Literal["run", "worker_cache", "shared_cache"] | None = None
    baseline_source: Literal["measured", "worker_cache", "shared_cache"] | None = None
    baseline_age_s: float | None = None
    traffic: Traffic | None = None
    speedup_eager: float | None = None
    speedup_compile: float | None = None
    compile_time_us: float | None = None
    peak_fraction: float | None = None
    peak_bound: Literal["memory", "compute"] | None = None
    launch_floor_us: float | None = None
    profiled_kernels: list[ProfiledKernel] = field(default_factory=list)
    compile_facts: list[CompileFact] = field(default_factory=list)
    finished_at: dt.datetime = field(default_factory=utcnow)
    # HMAC of the request's claim nonce over this verdict's worker and request
    # (services/common/verdicts.py: ``proof``); empty when the request had no nonce.
    proof: str = ""
    type: Literal["verify.result"] = "verify.result"
    schema_version: int = SCHEMA_VERSION


class VerifyClaim(Struct, kw_only=True):
    """A worker's claim of a verify request it was delivered, published on
    ``results.<job_id>.<worker_id>.claim`` before it runs the request.

    The latest claim of a request names the worker that holds it (JetStream hands a
    request to a second worker only after the first gave it back or went silent);
    a verdict counts only from that worker (services/common/verdicts.py).
    ``proof``: HMAC of the request's ``claim_nonce`` (which only the delivered
    worker read) over ``claim``, the worker id and the request id.
    """

    request_id: str
    job_id: str
    worker_id: str
    device: str = ""
    proof: str = ""
    claimed_at: dt.datetime = field(default_factory=utcnow)
    type: Literal["verify.claim"] = "verify.claim"
    schema_version: int = SCHEMA_VERSION


class EvolveCandidate(Struct, kw_only=True):
    """One candidate of an evolve job, as kept in the job's evolve summary.

    ``params`` are the built-in coder's launch parameters (``block_size``,
    ``num_warps``, ``num_stages``) when it wrote the candidate. ``passed`` is None
    while the candidate is being verified. ``duplicate_of`` names an earlier
    candidate with the same normalised code, whose verdict was reused.
    ``modeled_time_us``, ``modeled_speedup`` and ``traffic_ratio`` come from the
    verdict's counted traffic (``VerifyResult.traffic``; a model of a GPU, not a
    measurement): the tile model's time and speedup over eager (``tile_time_us``,
    ``tile_speedup``: L2, occupancy, the tile's shape) where the verdict has them, else
    the roofline's (``modeled_time_us``, ``modeled_speedup``).
    """

    candidate_id: str
    island: int
    round: int
    coder: str
    code_hash: str
    parent_id: str | None = None
    params: dict[str, int] = field(default_factory=dict)
    passed: bool | None = None
    stage: Stage | None = None
    error: str | None = None
    speedup: float | None = None
    gen_time_us: float | None = None
    base_time_us: float | None = None
    modeled_time_us: float | None = None
    modeled_speedup: float | None = None
    traffic_ratio: float | None = None
    duplicate_of: str | None = None
    code: str | None = None


class Migration(Struct, kw_only=True):
    """Copies of an island's best candidates placed on another island after a round."""

    round: int
    source_island: int
    target_island: int
    candidate_ids: list[str]


class ParentChoice(Struct, kw_only=True):
    """Which parent a child was bred from; ``migrant`` when the parent came to the
    island by migration (so the migration changed this choice)."""

    child_id: str
    island: int
    round: int
    parent_id: str
    migrant: bool = False
    elite: bool = False


class EvolveSummary(Struct, kw_only=True):
    """State of an evolve job, kept in its record: candidates per island, the elite
    archive across islands, migrations and parent choices. ``fitness`` says how
    candidates were ranked: ``speedup`` on devices with meaningful timings,
    ``modeled_time`` on the cpu backend (correctness, then the candidate's
    ``modeled_time_us``, lower is better: the tile model of the request's GPU, else the
    roofline, built on the interpreter's counted bytes, FLOPs and launches), ``correctness`` alone where
    neither exists (an evolve job recorded before verdicts counted traffic)."""

    rounds: int
    round: int = 0
    fitness: Literal["speedup", "modeled_time", "correctness"] = "speedup"
    islands: list[list[str]] = field(default_factory=list)
    elites: list[str] = field(default_factory=list)
    migrations: list[Migration] = field(default_factory=list)
    parent_choices: list[ParentChoice] = field(default_factory=list)
    candidates: list[EvolveCandidate] = field(default_factory=list)


class JobResult(Struct, kw_only=True):
    """What a finished job produced: the kernel source and the worker's verdict on it."""

    passed: bool
    code: str | None = None
    verdict: VerifyResult | None = None
    candidate_id: str | None = None
    coder: str | None = None
    # The LLM model that wrote the kernel, as the endpoint named it (None: no LLM).
    model: str | None = None
    attempts: int = 0
    speedup: float | None = None
    # Evolve jobs: the best candidates, best first, with code, round, island and parent.
    best: list[EvolveCandidate] = field(default_factory=list)


# Phase names of JobRecord.phases (seconds each).
JOB_PHASES: dict[str, str] = {
    "queue": "from submit_time to a generator starting the job",
    "lowering": "the built-in coder writing candidates (its sandboxed lowering)",
    "llm": "LLM calls (coder, designer, conductor)",
    "verify_wait": "from publishing each verify request to its verdict, all attempts",
    "other": "the rest until the job ended: job record and event updates",
}


class JobRecord(Struct, kw_only=True):
    """A job's state: the value of key ``<job_id>`` in bucket ``jobs``.

    Also the body of ``GET /api/v1/jobs/{job_id}/status``; ``status``, ``job_type``,
    ``op_name``, ``submit_time``, ``result`` and ``error`` are the reference server's
    fields. Updated by compare-and-swap on the key's revision.

    ``phases``: where a finished job's time went, seconds per phase (names and
    meanings: :data:`JOB_PHASES`), measured by the generator; they add up to
    ``end_time - submit_time``. Empty until the job ends (and for evolve jobs, which
    record only ``queue`` and ``verify_wait``).

    ``tenant`` is the tenant that submitted the job (its API token's, or the lane
    subject's for a raw ``nats pub``); ``priority`` its lane's. ``queue_position`` (1:
    next to start) and ``estimated_start_time`` are never stored: the status route
    fills them in while the job waits in the JOBS stream, and leaves them null once it
    has started (or when they cannot be told).
    """

    job_id: str
    status: JobStatus
    job_type: JobType
    op_name: str
    submit_time: dt.datetime
    backend: str
    arch: str | None
    request: JobSubmit
    progress: JobProgress = field(default_factory=JobProgress)
    result: JobResult | None = None
    error: str | None = None
    start_time: dt.datetime | None = None
    end_time: dt.datetime | None = None
    updated_at: dt.datetime = field(default_factory=utcnow)
    evolve: EvolveSummary | None = None
    phases: dict[str, float] = field(default_factory=dict)
    tenant: str = "default"
    priority: Priority = "normal"
    queue_position: int | None = None
    estimated_start_time: dt.datetime | None = None
    type: Literal["job.record"] = "job.record"
    schema_version: int = SCHEMA_VERSION


BatchStatus = Literal["running", "completed", "cancelled"]
# Largest candidate list one batch may carry, whatever the gateway's setting
# (``batch_max_candidates``): the schema's own bound, so the OpenAPI document states
# one; a batch is also bounded by the gateway's 2 MiB request body.
BATCH_MAX_CANDIDATES = 4096
# A batch id leaves room for the ``-r<index>`` / ``-c<index>`` of its request and
# candidate ids within a subject token's 64 characters.
BatchId = Annotated[str, Meta(pattern=_TOKEN_PATTERN, min_length=1, max_length=56,
                              description="Client-chosen or generated batch id; also the "
                              "job_id of the batch's verify requests")]


class BatchSubmit(Struct, kw_only=True, forbid_unknown_fields=True):
    """Body of ``POST /api/v1/verify/batch``: one task and the candidates to verify
    against it (each a module defining ``class ModelNew``).

    The task fields mean what they mean in :class:`JobSubmit`; ``trials`` and
    ``timeout_s`` (seconds) apply to each verification. ``batch_id``: client-chosen
    (else a fresh one); it is the ``job_id`` of the batch's verify requests, so their
    verdicts go on ``results.<batch_id>``.
    """

    op_name: OpName
    task_desc: Source
    candidates: Annotated[list[Source], Meta(min_length=1, max_length=BATCH_MAX_CANDIDATES)]
    backend: Backend = "cpu"
    arch: Token | None = None
    dsl: Dsl = "triton"
    framework: Framework = "torch"
    shape_overrides: ShapeOverrides = field(default_factory=dict)
    timeout_s: Annotated[float, Meta(gt=0, le=3600)] = 300.0
    trials: Annotated[int, Meta(ge=1, le=20)] = 3
    # Accept a partial check for each candidate (VerifyRequest.allow_unchecked).
    allow_unchecked: bool = False
    priority: Priority = "normal"
    batch_id: BatchId | None = None
    type: Literal["batch.submit"] = "batch.submit"
    schema_version: int = SCHEMA_VERSION


class BatchTask(Struct, kw_only=True):
    """The task of a batch as kept in its record: :class:`BatchSubmit` without the
    candidates' code (each is in its verify request)."""

    op_name: str
    task_desc: str
    backend: str
    arch: str
    dsl: str = "triton"
    framework: str = "torch"
    shape_overrides: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 300.0
    trials: int = 3
    priority: Priority = "normal"
    allow_unchecked: bool = False


class BatchCandidate(Struct, kw_only=True):
    """One candidate of a batch: its place in the submitted list (``index``, from 0),
    ``candidate_id`` (``<batch_id>-c<index>``), ``code_hash`` (sha256 of its
    normalised AST) and the verify request that decides it: its own, or, for a
    candidate identical to an earlier one, that one's (``duplicate_of`` names the
    earlier index; no request of its own is sent). ``verify_seq``: the VERIFY stream
    sequence of the request (0 for a duplicate, or before it was published).
    ``cancelled``: the batch was cancelled before its request was delivered to a
    worker, and the request was taken back: it gets no verdict."""

    index: int
    candidate_id: str
    request_id: str
    code_hash: str
    duplicate_of: int | None = None
    verify_seq: int = 0
    cancelled: bool = False


class BatchVerdict(Struct, kw_only=True):
    """A candidate's verdict as kept in its batch record and streamed: a summary of
    the :class:`VerifyResult` of its request (the whole result stays on
    ``results.<batch_id>`` in the RESULTS stream). ``duplicate_of``: the verdict is
    that earlier candidate's, reused. ``seq``: the RESULTS stream sequence of the
    result (verdicts of one result share it). Times are microseconds, ``duration_s``
    seconds."""

    index: int
    candidate_id: str
    request_id: str
    passed: bool
    stage: Stage | None = None
    error: str | None = None
    duplicate_of: int | None = None
    speedup: float | None = None
    base_time_us: float | None = None
    gen_time_us: float | None = None
    max_abs_error: float | None = None
    trials: int = 0
    interpreted: bool = False
    duration_s: float = 0.0
    worker_id: str = ""
    reference_source: str | None = None
    baseline_source: str | None = None
    finished_at: dt.datetime = field(default_factory=utcnow)
    seq: int = 0


class BatchRecord(Struct, kw_only=True):
    """A batch verification, the value under ``<batch_id>`` in the ``batches`` bucket.

    ``candidates``: every submitted candidate in submission order; ``verdicts``: one
    per candidate whose verdict has landed, in the order they finished (the RESULTS
    stream's order); ``status``: ``running`` until every candidate has a verdict
    (``completed``), or ``cancelled`` (requests not yet delivered to a worker are
    taken back; verdicts of verifications already started may still land).
    ``unique``: verify requests sent (candidates less duplicates); ``backend`` and
    ``arch`` are in ``task``.
    """

    batch_id: str
    status: BatchStatus
    tenant: str
    submit_time: dt.datetime
    task: BatchTask
    candidates: list[BatchCandidate]
    unique: int
    verdicts: list[BatchVerdict] = field(default_factory=list)
    end_time: dt.datetime | None = None
    updated_at: dt.datetime = field(default_factory=utcnow)
    type: Literal["batch.record"] = "batch.record"
    schema_version: int = SCHEMA_VERSION


JobEventKind = Literal[
    "submitted",
    "queued",
    "started",
    "candidate_generated",
    "verify_started",
    "verify_result",
    "verify_phase",
    "progress",
    "completed",
    "failed",
    "cancelled",
    "error",
]


class JobEvent(Struct, kw_only=True):
    """One step of a job, published on ``jobs.events.<job_id>`` (stream JOB_EVENTS).

    ``queued`` events are not published: the gateway's event stream (SSE) sends one
    whenever the job's queue position changes while it waits, with ``data``
    ``{"queue_position": int, "estimated_start_time": RFC 3339 or null}``.

    ``verify_phase`` events come from the worker verifying ``request_id``: ``phase``
    says which phase of the verification started (``message`` says it in words; the
    last one sent is the ``verdict`` ended), at most a few a second per request
    (services/worker/progress.py). Any service may
    publish on a job's events subject, so they are shown, never trusted: a verdict is
    only the signed :class:`VerifyResult`, and a job's outcome only its record.
    """

    job_id: str
    event: JobEventKind
    status: JobStatus | None = None
    message: str = ""
    candidate_id: str | None = None
    request_id: str | None = None
    verdict: VerifyResult | None = None
    phase: VerifyPhase | None = None
    data: dict[str, Any] = field(default_factory=dict)
    time: dt.datetime = field(default_factory=utcnow)
    type: Literal["job.event"] = "job.event"
    schema_version: int = SCHEMA_VERSION


class WorkerInfo(Struct, kw_only=True):
    """A live worker: value of key ``<worker_id>`` in bucket ``workers``, put as heartbeat.

    ``devices`` are device names (``"0"``, ``"1"`` … for GPUs, slots on ``cpu``);
    ``capacity`` is how many candidates it runs at once; ``in_flight`` how many it runs now.
    ``sandbox``: each isolation mechanism of its sandbox in a phrase (``user 65534``,
    ``no capabilities``, ``no network``, ``landlock v7``, ``seccomp``; ``no landlock``
    when missing); ``sandbox_notes``: why a mechanism is missing on that machine.
    """

    worker_id: str
    backend: str
    arch: str
    devices: list[str]
    capacity: int
    in_flight: int = 0
    host: str = ""
    version: str = ""
    started_at: dt.datetime = field(default_factory=utcnow)
    updated_at: dt.datetime = field(default_factory=utcnow)
    status: Literal["running", "draining"] = "running"
    sandbox: list[str] = field(default_factory=list)
    sandbox_notes: list[str] = field(default_factory=list)
    type: Literal["worker.info"] = "worker.info"
    schema_version: int = SCHEMA_VERSION


class KernelRow(Struct, kw_only=True):
    """One job's kernel with its task, verdict, timings and provenance: a row of
    ``GET /api/v1/kernels`` and of ``aikg export`` (JSON Lines and Parquet).

    Flat, so that every field is one Parquet column: ``shape_overrides`` is the
    job's shape_overrides as JSON text; times are microseconds (``base_time_us`` the
    eager reference, ``gen_time_us`` the kernel; None on the cpu backend, where
    Triton is interpreted) and ``verify_duration_s`` seconds. Provenance: ``job_id``,
    ``candidate_id``, ``coder`` (``builtin``, ``llm``, ``init_code``), ``model`` (the
    LLM's, None otherwise), ``worker_id`` / ``device`` that verified it.
    ``task_sha256`` / ``code_sha256``: sha256 of the UTF-8 sources, hex.
    """

    job_id: str
    candidate_id: str | None
    op_name: str
    job_type: str
    status: str
    backend: str
    arch: str | None
    dsl: str
    framework: str
    workflow: str
    coder: str | None
    model: str | None
    task_desc: str
    task_sha256: str
    shape_overrides: str
    code: str
    code_sha256: str
    passed: bool
    stage: str | None
    error: str | None
    attempts: int
    trials: int | None
    max_abs_error: float | None
    max_rel_error: float | None
    atol: float | None
    rtol: float | None
    base_time_us: float | None
    gen_time_us: float | None
    speedup: float | None
    interpreted: bool | None
    worker_id: str | None
    device: str | None
    verify_duration_s: float | None
    baseline_source: str | None
    submit_time: dt.datetime
    end_time: dt.datetime | None
    type: Literal["kernel.row"] = "kernel.row"
    schema_version: int = SCHEMA_VERSION


T = TypeVar("T")

_encoder = msgspec.json.Encoder()


def encode(obj: Any) -> bytes:
    """Encode a record as compact JSON bytes."""
    return _encoder.encode(obj)


def decode(data: bytes | str, type: type[T]) -> T:
    """Decode JSON bytes into ``type``, with msgspec's strict rules.

    Strict (https://jcristharif.com/msgspec/usage.html#strict-vs-lax-mode): a number in
    a string (``"max_rounds": "3"``), a float for an integer field or a string for a
    boolean is refused; an integer for a float field is accepted. Every door applies
    this rule: the generator decoding a raw ``nats pub`` on ``jobs.submit`` and the
    gateway's ``POST /api/v1/jobs/submit`` (whose framework alone would be lax).

    Raises:
        msgspec.ValidationError: the JSON is well-formed but breaks the schema; the
            message names the field (``... - at `$.backend```).
        msgspec.DecodeError: the bytes are not JSON.
    """
    return msgspec.json.decode(data, type=type, strict=True)


ALL_RECORDS: tuple[type[Struct], ...] = (
    JobSubmit,
    JobRecord,
    JobEvent,
    VerifyRequest,
    VerifyResult,
    VerifyClaim,
    WorkerInfo,
    KernelRow,
    BatchSubmit,
    BatchRecord,
)
