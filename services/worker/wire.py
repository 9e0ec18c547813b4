"""The worker's children's messages: what the reference, the candidate's planner, the
replayer and the compile child are sent and answer, beyond the sandbox's generic
frames (:mod:`services.sandbox.wire`: spec, hello, progress, failure, done, bye), and
the registration of those four roles with the sandbox.

Imported by both sides: the worker decodes with the roles' decoders, and every child
of these roles imports this module through its runner, which registers the roles'
messages there too. The roles' runners are named by dotted path, so registering them
imports none of the child code (:mod:`services.sandbox.roles`).

The roles' rows of the sandbox's limits table (:mod:`services.sandbox.limits`,
settings ``sandbox_<row>_address_space_bytes`` and ``sandbox_<row>_cpu_s`` in
services/common/settings.py):

- ``reference``, the task's code (inputs, reference outputs): 8 GiB of address space
  by default;
- ``candidate``, the candidate's planner, and its kernels' replayers (role ``replay``
  takes this row): 0, that is 16x the task's input bytes plus 2 GiB;
- ``compile``, the GPU compile check (the candidate's kernel module and Triton's
  compiler, :mod:`services.worker.aot`): 4 GiB (a compile here grew the address space
  by about 30 MiB, and LLVM's thread pool may add a stack and a malloc arena, 72 MiB,
  per core), 600 s of CPU time. Its address space is bounded on every backend: the
  compile child maps no device memory.

It does not import torch: decoding frames needs none. Its annotations are evaluated at
import (no ``from __future__ import annotations``): msgspec may resolve a message type
after a candidate's process removed the harness's modules from ``sys.modules``
(:func:`services.sandbox.guard.hide_harness`), and objects need no module to resolve
in, where strings do.
"""

from typing import Any

import msgspec

from schemas.events import EagerCount, LaunchTraffic
from services.sandbox.roles import register_role
from services.sandbox.wire import TensorMeta

# The candidate child's first Progress after loading the task (the parent laps
# ``candidate_start`` on it).
IMPORT_PHASE = "importing the candidate"


class ChildParams(msgspec.Struct, kw_only=True):
    """What the worker's children read from :attr:`ChildSpec.params
    <services.sandbox.wire.ChildSpec.params>` (:func:`params_of`).

    ``warmup`` untimed and ``repeats`` timed calls per timing, before each a
    ``flush_bytes`` buffer overwritten (:mod:`services.worker.timing`);
    ``emulate_cuda``: the planner answers CUDA calls on the cpu backend
    (:mod:`services.worker.emulation`); ``compile_target`` / ``compile_specs``: what
    the compile child compiles (:func:`services.worker.aot.run_compile`).
    """

    warmup: int = 3
    repeats: int = 20
    flush_bytes: int = 256 << 20
    emulate_cuda: bool = True
    compile_target: str = ""
    compile_specs: list[Any] = []


def params_of(spec: Any) -> ChildParams:
    """The :class:`ChildParams` of a child spec (defaults for what it does not set).

    Raises:
        msgspec.ValidationError: a parameter has the wrong type.
    """
    return msgspec.convert(spec.params, ChildParams)


# ---------------------------------------------------------------- timing


class ProfiledLaunch(msgspec.Struct, array_like=True):
    """One device activity ``torch.profiler`` recorded in a timing loop
    (:func:`services.worker.profiling.profiled_launches`): ``name``, ``kind``
    (``kernel``, ``memcpy``, ``memset``), ``op`` (the outermost ATen operator inside the
    range that launched it; None: launched outside any operator, as Triton launches),
    ``region`` (the harness range it ran in, None: outside both) and ``device_us``
    (its device time, microseconds)."""

    name: str
    kind: str
    op: str | None
    region: str | None
    device_us: float = 0.0


class Timing(msgspec.Struct, tag="timing"):
    """Device-event timings of the forward call, microseconds; ``wall_s`` the child's wall time.

    ``label``: what was timed (``""`` the model's forward; ``eager``, ``compile`` and
    ``floor`` in answer to a :class:`RefProfile`); ``error``: why it could not be timed
    (``compile``: torch.compile failed; no samples then). ``launches``: what the
    profiler recorded over the timed calls when they ran under ``torch.profiler``;
    ``profiler_error``: why the profiler recorded nothing (it could not start or stop).
    """

    median_us: float
    samples_us: list[float]
    wall_s: float
    label: str = ""
    error: str = ""
    launches: list[ProfiledLaunch] = []
    profiled: bool = False
    profiler_error: str = ""


# ---------------------------------------------------------------- reference child


class RefTrialSpec(msgspec.Struct):
    """One input set to make: ``seed`` for ``get_inputs()``, the distribution to
    redraw floating tensors from (:data:`services.worker.inputs.DISTRIBUTIONS`),
    ``decoy`` (inputs for the candidate's planner: no redraw), ``declared`` (index into
    the task's ``get_inputs_dyn_list()``; None: ``get_inputs()``)."""

    index: int
    seed: int
    distribution: str = "task"
    decoy: bool = False
    declared: int | None = None


class RefRequest(msgspec.Struct, tag="ref.request"):
    """Parent -> reference child: make inputs and outputs at one set of sizes.

    ``key`` names the sizes in the answers; ``overrides`` are module-level names
    rebound first (they must exist). ``meta_only``: shapes only (fake tensors, nothing
    allocated) for the candidate's dry run. ``input_limit_bytes``: refuse (a RefSize
    with ``refused``) when the inputs are larger. ``count_eager``: after the trials,
    count the task's eager graph at these sizes (``RefDone.eager``).
    """

    key: str
    overrides: dict[str, Any]
    trials: list[RefTrialSpec] = []
    meta_only: bool = False
    input_limit_bytes: int | None = None
    count_eager: bool = False


class RefProfile(msgspec.Struct, tag="ref.profile"):
    """Parent -> reference child (GPU): time ``Model`` at sizes ``key`` on the last real
    inputs it made there; answered with a :class:`Timing` per part asked for, in this
    order: ``eager`` (``Model`` as it is; label ``""``), ``floor`` (a one-element fill
    kernel, timed the same way under the profiler: the launch floor; label ``floor``),
    ``compile`` (``torch.compile(Model)``, compiled first; label ``compile``)."""

    key: str
    eager: bool = True
    floor: bool = False
    compile: bool = False


class RefSize(msgspec.Struct, tag="ref.size"):
    """Reference -> parent, first answer for a key: the inputs' size (``estimated`` on
    fake tensors), the task's module-level sizes, the constructor arguments
    (``init``: an encoded value tree, its tensors in raw frames after this one), and
    how many shapes ``get_inputs_dyn_list()`` declares (0: none). ``refused``: the
    inputs exceed the limit (nothing else follows for this key)."""

    key: str
    input_bytes: int
    estimated: bool
    size_names: dict[str, Any]
    init: Any = None
    declared: int = 0
    refused: bool = False
    # Value digests of the task Model's tensors (services.worker.init_compute).
    state: list[str] = []


class RefMeta(msgspec.Struct, tag="ref.meta"):
    """Reference -> parent (``meta_only``): constructor arguments and inputs as shapes
    (tensor refs with storage -1), for a dry run on the meta device."""

    key: str
    init: Any
    inputs: Any
    input_bytes: int
    size_names: dict[str, Any] = {}


class RefTrial(msgspec.Struct, tag="ref.trial"):
    """Reference -> parent: one input set (``inputs``: encoded tree, tensors as raw
    frames), then its outputs (``outputs``: one raw frame each, after the inputs').
    ``distribution``: the one used (after a fall back for the task's domain);
    ``fallback``: why it is not the one asked for. ``aliasing``: outputs of ``Model``
    that share memory with its inputs; ``inputs_after``: sha256 of each tensor input
    after ``Model`` ran (a task may modify its inputs; the candidate must do the same)."""

    key: str
    index: int
    decoy: bool
    distribution: str
    inputs: Any
    outputs: list[TensorMeta]
    aliasing: list[str] = []
    inputs_after: list[str] = []
    fallback: str | None = None


class RefFailed(msgspec.Struct, tag="ref.failed"):
    """Reference -> parent: the task's own code failed at the sizes ``key`` (the child
    goes on answering other requests)."""

    key: str
    stage: str
    message: str
    traceback: str = ""


class RefRecheck(msgspec.Struct, tag="ref.recheck"):
    """Parent -> reference child: run trial ``index`` of sizes ``key`` again with the
    task's ``Model`` in float64 (the float64 recheck, :func:`services.worker.correctness.recheck`).

    ``inputs``: the trial's inputs as its :class:`RefTrial` encoded them, raw frames
    following; ``overrides``: the sizes' module-level names, as in the
    :class:`RefRequest`; ``digests``: sha256 (``services.worker._reference.digest``) of
    each of the trial's outputs, which a fresh ``Model`` must reproduce in float32
    before its float64 outputs count; ``max_output_bytes``: the largest float64 output
    to send (a larger one is answered with an error). Answered by a :class:`RefRechecked`.
    """

    key: str
    index: int
    overrides: dict[str, Any]
    inputs: Any
    digests: list[str]
    max_output_bytes: int


class RefRechecked(msgspec.Struct, tag="ref.rechecked"):
    """Reference -> parent: the float64 outputs of trial ``index`` of ``key`` (one raw
    frame each), or ``error``: why there are none (the Model cannot run in float64, a
    fresh Model does not reproduce the trial's outputs, an output is too large)."""

    key: str
    index: int
    outputs: list[TensorMeta] = []
    error: str = ""


class RefDone(msgspec.Struct, tag="ref.done"):
    """Reference -> parent: every trial of ``key`` was sent. ``eager``: the task's eager
    graph at these sizes, counted (asked for with ``RefRequest.count_eager``; None when
    not asked or it could not be counted)."""

    key: str
    eager: EagerCount | None = None


# ---------------------------------------------------------------- planner (candidate) child


class PlanBuild(msgspec.Struct, tag="plan.build"):
    """Parent -> planner: construct ``ModelNew(*init)`` for sizes ``key`` (``meta``: on
    the meta device, for a dry run). ``init``'s tensors follow as raw frames (none for
    meta, whose refs have storage -1). ``optional``: a failing constructor is answered
    (``Built.error``) instead of failing the child."""

    key: str
    init: Any
    meta: bool = False
    optional: bool = False


class PlanDryRun(msgspec.Struct, tag="plan.dry"):
    """Parent -> planner: run ``forward`` of the model built for ``key`` on meta
    inputs of these shapes; every launch recorded, none run."""

    key: str
    inputs: Any


class PlanCall(msgspec.Struct, tag="plan.call"):
    """Parent -> planner: run ``forward`` of the model built for ``model`` on decoys
    (``inputs``, raw frames follow) and send the plan of call ``key``/``index``."""

    key: str
    index: int
    model: str
    inputs: Any
    # How the ghost run fills fresh allocations (services.worker.trace.Fill); drawn by
    # the worker per call, apart from every replay's. None: the fixed fill.
    fill_kind: str = "nan"
    fill_seed: int | None = None


class PlanProfile(msgspec.Struct, tag="plan.profile"):
    """Parent -> planner (GPU): time ``forward`` of ``model`` on its last decoys, the
    launches really running."""

    model: str


class Built(msgspec.Struct, tag="plan.built"):
    """Planner -> parent: the model for ``key`` exists (``error``: why not, for a meta or
    optional build)."""

    key: str
    error: str | None = None


class DryRun(msgspec.Struct, tag="plan.dryrun"):
    """Planner -> parent: the launches ``forward`` made on meta inputs for ``key``
    (launch events of :mod:`services.worker.trace`), or why it could not run."""

    key: str
    launches: list[Any] = []
    error: str | None = None


class Imported(msgspec.Struct, tag="plan.imported"):
    """Planner -> parent, once the candidate's module is imported: the attributes of
    torch or triton its import replaced, and what the audit hook refused so far."""

    namespace: list[str]
    refused: list[str] = []


class Traced(msgspec.Struct, tag="plan.traced"):
    """Planner -> parent: the plan of one call (see :mod:`services.worker.trace`).

    ``inputs``: the decoys as the plan names them; ``captures``: (storage id, bytes)
    of storages the plan did not create, whose bytes follow as raw frames, then one raw
    frame per output (``output_metas``: what the planner's own, ghost, run returned).
    ``refused`` / ``refused_ops``: what the audit hook and the dispatcher refused so
    far in the candidate's process (as in :class:`Audit`).
    """

    key: str
    index: int
    inputs: Any
    events: list[Any]
    captures: list[tuple[int, int]]
    outputs: Any
    output_metas: list[TensorMeta]
    refused: list[str] = []
    refused_ops: dict[str, int] = {}
    # Captured storages whose bytes torch computed before forward (rule D030,
    # services.worker.init_compute): dicts with id, name, shape, dtype, ops, digests.
    init_computed: list[Any] = []


class Audit(msgspec.Struct, tag="audit"):
    """Planner -> parent, last: what the in-child instruments saw over its whole life.

    ``refused``: events the audit hook refused, threads or processes refused;
    ``refused_ops``: ATen overload -> calls the dispatcher refused; ``namespace``:
    attributes of torch or triton the candidate's import replaced; ``cuda``: CUDA
    calls answered by the emulation; ``notes``: how the candidate was run.
    """

    refused: list[str]
    refused_ops: dict[str, int]
    namespace: list[str]
    notes: list[str]
    cuda: list[str] = []


# ---------------------------------------------------------------- replayer child


class ReplayRequest(msgspec.Struct, tag="replay.request"):
    """Parent -> replayer: execute one recorded call on real inputs.

    ``fresh``: start from no storage (a variant of the first call); ``captures``:
    (storage id, bytes) raw frames that follow first; ``inputs``: the plan's input
    refs; ``real``: the real inputs (encoded, raw frames after the captures'), tensor
    for tensor in the same order. ``skip_launches`` / ``config``: the variant
    (:class:`services.worker.replay.Variant`); ``label`` names it in the answer.
    ``fill_kind`` / ``fill_seed``: how fresh allocations are filled
    (:class:`services.worker.trace.Fill`; None: NaN, integers their largest, bool True).
    ``order_seed``: run every launch of more than one program in other orders too
    (reversed, a permutation drawn from the seed, concurrently) and fail when its
    outputs differ (None: program order only). ``autotune_runs``: how often each
    config of a multi-config autotuned launch runs (benchmark runs, then the real one).
    The seeds and the count are the worker's secrets.
    """

    key: str
    index: int
    label: str
    events: list[Any]
    captures: list[tuple[int, int]]
    inputs: Any
    real: Any
    outputs: Any
    fresh: bool = False
    skip_launches: bool = False
    config: int | None = None
    fill_kind: str = "nan"
    fill_seed: int | None = None
    order_seed: int | None = None
    autotune_runs: int = 2


class Replayed(msgspec.Struct, tag="replay.done"):
    """Replayer -> parent: the outputs (raw frames), then each input tensor as it was
    after the call (raw frames; None for a non-tensor). ``traffic``: the call's
    launches, counted (empty where the replayer cannot count); ``captured_bytes``: the
    bytes of the captured storages its launches were given."""

    key: str
    index: int
    label: str
    outputs: list[TensorMeta]
    inputs_after: list[TensorMeta | None]
    launches: int = 0
    traffic: list[LaunchTraffic] = msgspec.field(default_factory=list)
    captured_bytes: int = 0


class ReplayFailed(msgspec.Struct, tag="replay.failed"):
    """Replayer -> parent: the call could not be replayed (``kind`` as
    :class:`services.worker.replay.ReplayError`; ``stage`` the verdict's)."""

    key: str
    index: int
    label: str
    kind: str
    stage: str
    message: str
    traceback: str = ""


# ---------------------------------------------------------------- compile child


class CompileResult(msgspec.Struct):
    """One kernel specialisation compiled ahead of time (``key`` as the spec's); the
    compiler's facts of it (``target`` ... ``limiter``: services/worker/gpu_facts.py
    ``KernelFacts``; ``facts_error`` when they could not be read)."""

    key: str
    ok: bool
    error: str = ""
    shared_bytes: int = 0
    num_warps: int = 0
    seconds: float = 0.0
    target: str = ""
    registers: int = 0
    spill_bytes: int = 0
    occupancy_warps: int = 0
    max_warps: int = 0
    limiter: str = ""
    facts_error: str = ""


class Compiled(msgspec.Struct, tag="compiled"):
    """Compile child -> parent: a result per spec of ``ChildSpec.compile_specs``."""

    results: list[CompileResult]


# ---------------------------------------------------------------- the roles


register_role("reference", "services.worker._reference:run_reference_role",
              frames=(RefSize, RefMeta, RefTrial, RefFailed, RefRechecked, RefDone, Timing),
              commands=(RefRequest, RefProfile, RefRecheck))
register_role("candidate", "services.worker._planner:run_planner",
              frames=(Built, DryRun, Imported, Traced, Audit, Timing),
              commands=(PlanBuild, PlanDryRun, PlanCall, PlanProfile))
register_role("replay", "services.worker._replayer:run_replayer",
              frames=(Replayed, ReplayFailed), commands=(ReplayRequest,), limits="candidate")
register_role("compile", "services.worker.aot:run_compile", frames=(Compiled,),
              address_space_off_cpu=True)
