"""The wire format between the worker and its sandboxed children.

Parent -> child: a :class:`ChildSpec` (msgpack), through the fork server
(:mod:`services.sandbox.forkserver`), then, on the same private socket, commands
(:data:`Command`) with the raw frames they announce. Child -> parent, over that socket,
never stdout: frames of an 8-byte big-endian length followed by the payload. A
payload is a msgpack-encoded :data:`Frame`; frames that carry tensors are followed by
one raw frame per tensor holding its bytes (row-major, native byte order). With a ``frame_key`` in the spec every frame
is followed by a 32-byte keyed BLAKE2b tag over the previous tag, the header and the
payload, so bytes the candidate writes on the socket's file descriptor (it can guess
the number) break the chain and the parent sees them
(:class:`services.sandbox.pool.ChildRun`).

This module is imported by both sides: the parent decodes with it, the child's
:class:`Channel` encodes with it (reading tensors through ``torch.Tensor`` methods
captured by :func:`capture_tensor_methods` when a child starts, before any candidate
code can reassign them). It does not import torch itself: a parent that only lowers
(the generator) never loads it (~3 s of CPU per process start).
"""

from __future__ import annotations

import hashlib
import socket
import struct
from typing import Any, Literal

import msgspec

from schemas.events import EagerCount, LaunchTraffic

HEADER = struct.Struct("!Q")
TAG_BYTES = 32
# Tensor methods captured before any candidate code runs (capture_tensor_methods):
# candidates can reassign ``torch.Tensor.contiguous`` and friends, not these references.
_TENSOR_METHODS: tuple[Any, ...] | None = None
# Files in the child's scratch directory that receive its stdout and stderr.
STDOUT_FILE = "stdout.txt"
STDERR_FILE = "stderr.txt"
# The child's working directory inside its scratch directory (a size-limited tmpfs
# where the machine permits): HOME, TMPDIR, the cwd.
WORK_DIR = "work"
# The candidate child's first Progress after loading the task (the parent laps
# ``candidate_start`` on it).
IMPORT_PHASE = "importing the candidate"


# A Progress phase that starts so names a call into the task's own code (its module
# code, get_init_inputs(), Model(...), get_inputs(), Model.forward) in the reference or
# lowering child; the parent bounds each such call (setting task_timeout_s, or
# lowering_timeout_s for a lowering) and names it when it does not finish.
TASK_PHASE = "the task's "


class ChildSpec(msgspec.Struct, kw_only=True):
    """One job for a sandboxed child (parent -> fork server -> child).

    Sizes are bytes, times seconds. ``env`` is set after the secret scrub;
    ``address_space_bytes`` is added to the child's address-space size at entry
    (None: no RLIMIT_AS). ``run_as`` is ``(uid, gid)`` to switch to when the fork
    server runs as root (None: keep the current user). ``scratch_bytes``: the size of
    the tmpfs the child works in (None: the scratch directory as it is).
    ``arch``: the request's arch (the GPU the cpu backend emulates and compiles for).
    ``limit_notes``: ``address_space`` / ``cpu`` -> the words naming that limit's
    setting and value (:mod:`services.sandbox.limits`), quoted in a failure
    that hit it. ``runner``: the ``module:function`` the child calls for ``role``
    (:func:`services.sandbox.roles.runner_of`; filled in from the registry when
    empty).
    """

    role: Literal["probe", "reference", "candidate", "replay", "compile", "lower"]
    scratch_dir: str
    runner: str = ""
    backend: str = "cpu"
    arch: str = ""
    env: dict[str, str] = {}
    task_path: str = ""
    candidate_path: str = ""
    shape_overrides: dict[str, Any] = {}
    profile: bool = False
    address_space_bytes: int | None = None
    cpu_seconds: int = 600
    file_size_bytes: int = 128 << 20
    open_files: int = 1024
    processes: int = 4096
    run_as: tuple[int, int] | None = None
    isolate_network: bool = True
    pid_namespace: bool = True
    scratch_bytes: int | None = None
    env_allow: list[str] = []
    landlock: bool = True
    seccomp: bool = True
    lower_params: dict[str, int | str] = {}  # lower_task's keywords (arch: a str)
    warmup: int = 3
    repeats: int = 20
    flush_bytes: int = 256 << 20
    frame_key: bytes = b""
    emulate_cuda: bool = True
    compile_target: str = ""
    compile_specs: list[Any] = []
    limit_notes: dict[str, str] = {}


class Hello(msgspec.Struct, tag="hello"):
    """The child entered its sandbox; ``notes`` lists isolation steps that failed.

    ``capabilities``: the bitwise OR of every capability set left (0: none);
    ``landlock_abi``: the Landlock ABI confining its files (0: none); ``seccomp``:
    whether the syscall filter is loaded; ``pid_namespace``: whether it is process 1 of
    its own PID namespace (with its own /proc); ``scratch_bytes``: the size of the
    tmpfs it works in (None: none).
    """

    pid: int
    uid: int
    network_isolated: bool
    address_space_bytes: int | None
    notes: list[str]
    capabilities: int = 0
    landlock_abi: int = 0
    seccomp: bool = False
    pid_namespace: bool = False
    scratch_bytes: int | None = None


class Progress(msgspec.Struct, tag="progress"):
    """The child started a phase (named in timeout messages)."""

    phase: str


class TensorMeta(msgspec.Struct):
    """dtype (``torch.float32`` spelled ``float32``), shape, and byte count of one tensor."""

    dtype: str
    shape: list[int]
    nbytes: int


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


class Failure(msgspec.Struct, tag="failure"):
    """The job failed at ``stage`` (a VerifyResult stage name)."""

    stage: str
    message: str
    traceback: str = ""


class Lowered(msgspec.Struct, tag="lowered"):
    """The built-in coder's candidate source for the task (role ``lower``)."""

    code: str


class Done(msgspec.Struct, tag="done"):
    """All frames were sent."""


class Bye(msgspec.Struct, tag="bye"):
    """Parent -> child: no more requests; finish and send Done."""


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


Frame = (Hello | Progress | Timing | Failure | Lowered | Done | RefSize | RefMeta | RefTrial
         | RefFailed | RefRechecked | RefDone | Built | DryRun | Imported | Traced | Audit | Replayed | ReplayFailed | Compiled)
Command = (Bye | RefRequest | RefProfile | RefRecheck | PlanBuild | PlanDryRun | PlanCall | PlanProfile
           | ReplayRequest)

_encoder = msgspec.msgpack.Encoder()
FRAME_DECODER = msgspec.msgpack.Decoder(Frame)
COMMAND_DECODER = msgspec.msgpack.Decoder(Command)
SPEC_DECODER = msgspec.msgpack.Decoder(ChildSpec)


def encode_frame(frame: Any) -> bytes:
    """msgpack bytes of a frame or command."""
    return _encoder.encode(frame)


def encode_spec(spec: ChildSpec) -> bytes:
    """msgpack bytes of ``spec`` (sent to the fork server)."""
    return _encoder.encode(spec)


def frame_tag(key: bytes, previous: bytes, header: bytes, payload: Any) -> bytes:
    """Keyed BLAKE2b (RFC 7693) of ``previous`` tag + ``header`` + ``payload``, 32 bytes."""
    h = hashlib.blake2b(key=key, digest_size=TAG_BYTES)
    h.update(previous)
    h.update(header)
    h.update(payload)
    return h.digest()


def capture_tensor_methods() -> None:
    """Capture the ``torch.Tensor`` methods :func:`tensor_bytes` reads tensors with.

    Called by every child at its start (:func:`services.sandbox.child.main`), before any
    job code runs, and by a parent at its first :func:`tensor_bytes`; the fork server
    never runs candidate code, so what its children capture is torch's own.
    """
    global _TENSOR_METHODS
    import torch

    t = torch.Tensor
    _TENSOR_METHODS = (t.detach, t.to, t.contiguous, t.reshape, t.view, t.numpy, t.numel,
                       torch.uint8, t)


def tensor_bytes(t: Any) -> Any:
    """A buffer over ``t``'s bytes (CPU, contiguous), via the captured methods."""
    if _TENSOR_METHODS is None:
        capture_tensor_methods()
    detach, to, contiguous, reshape, view, numpy, numel, uint8, _ = _TENSOR_METHODS
    if not numel(t):
        return b""
    return numpy(view(reshape(contiguous(to(detach(t), "cpu")), -1), uint8))


class Channel:
    """The child's end of the result socket (blocking writes), tagging frames with ``key``."""

    def __init__(self, fd: int, key: bytes = b"") -> None:
        self.sock = socket.socket(fileno=fd)
        self.sock.setblocking(True)
        self._key = key
        self._tag = b""

    def _write(self, payload: Any) -> None:
        header = HEADER.pack(len(payload))
        tag = b""
        if self._key:
            tag = self._tag = frame_tag(self._key, self._tag, header, payload)
        if isinstance(payload, bytes) and len(payload) < (1 << 16):
            self.sock.sendall(header + payload + tag)
            return
        self.sock.sendall(header)
        if len(payload):
            self.sock.sendall(memoryview(payload))
        if tag:
            self.sock.sendall(tag)

    def send(self, frame: Any, raws: list[Any] = ()) -> None:
        """Write ``frame``, then each raw frame: a tensor's bytes, or a buffer as it is."""
        self._write(_encoder.encode(frame))
        tensor = _TENSOR_METHODS[-1] if _TENSOR_METHODS is not None else ()
        for t in raws:
            self._write(tensor_bytes(t) if isinstance(t, tensor) else t)

    def _read_exactly(self, n: int) -> bytearray | None:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if k == 0:
                return None
            got += k
        return buf

    def recv(self) -> Any:
        """The parent's next command (:data:`Command`); None when it closed the socket.

        Raises:
            msgspec.DecodeError: a malformed command.
        """
        data = self.recv_raw()
        return None if data is None else COMMAND_DECODER.decode(data)

    def recv_raw(self) -> bytearray | None:
        """The parent's next raw frame (length-prefixed bytes); None at end of stream."""
        header = self._read_exactly(HEADER.size)
        if header is None:
            return None
        (size,) = HEADER.unpack(header)
        return self._read_exactly(size) if size else bytearray()
