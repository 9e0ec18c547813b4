"""The reference child: the task's own code only, making every input a verification
uses and the outputs the candidate must match.

It is the one process that knows the trial seeds. For each :class:`RefRequest` (one
set of sizes) it rebinds the task's module-level sizes, measures the inputs on fake
tensors before allocating anything, sends the constructor arguments, builds ``Model``
under :data:`services.worker.inputs.INIT_SEED`, then per trial makes the inputs
(``get_inputs()`` under the trial's seed, redrawn from its distribution; or one of
``get_inputs_dyn_list()``'s declared shapes), runs ``Model`` and sends inputs and
outputs as raw bytes. Decoys (inputs for the candidate's planner) are made the same
way from other seeds, with their outputs for the worker's diagnosis. ``meta_only``
requests answer with shapes, nothing allocated (for the candidate's dry run).

A :class:`RefRecheck` (the float64 recheck of a failed trial,
:func:`services.worker.correctness.recheck`) brings a trial's inputs back: a fresh
``Model`` built as for its sizes must reproduce the trial's outputs in float32, then
one built the same way and converted with ``.double()`` runs on the inputs in float64.
Only the task's code runs; the inputs are the ones this child made.

A failure of the task's own code is stage ``infrastructure`` with the task named: the
candidate had no part in it; one that ran out of the child's address space is stage
``task``, naming the limit. Each call into the task's code is announced with a
:data:`~services.sandbox.wire.TASK_PHASE` progress frame (and the end of it with
another), so the worker can bound it and name the call that hangs.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any

import torch

from schemas.events import EagerCount
from services.common.task_source import REQUIRED_TASK_NAMES, unknown_overrides_message
from services.sandbox import values
from services.sandbox.child import JobFailure, failure_of, out_of_memory, seed_all
from services.sandbox.wire import TASK_PHASE, Bye, Channel, ChildSpec, Failure, Progress, TensorMeta
from services.worker import init_compute
from services.worker import inputs as trial_inputs
from services.worker.harness import forward_outputs
from services.worker.profiling import profiled_launches
from services.worker.wire import (
    RefDone,
    RefFailed,
    RefMeta,
    RefProfile,
    RefRecheck,
    RefRechecked,
    RefRequest,
    RefSize,
    RefTrial,
)


def size_names(task: Any) -> dict[str, Any]:
    """The task's module-level sizes: ints above 1 and tuples of such ints."""
    names: dict[str, Any] = {}
    for name, value in vars(task).items():
        if name.startswith("_"):
            continue
        if type(value) is int and value > 1:
            names[name] = value
        elif type(value) is tuple and value and all(type(v) is int and v > 0 for v in value):
            names[name] = list(value)
    return names


def digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes."""
    h = hashlib.sha256()
    t = t.detach().to("cpu").contiguous()
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    if t.numel():
        h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def _meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(dtype=values.dtype_name(t.dtype), shape=list(t.shape),
                      nbytes=t.numel() * t.element_size())


def _aliasing(outputs: list[torch.Tensor], args: list[Any]) -> list[str]:
    """Facts about outputs sharing memory with inputs (the task may return a view)."""
    facts = []
    for i, o in enumerate(outputs):
        if not o.untyped_storage().nbytes():
            continue
        for j, a in enumerate(args):
            if isinstance(a, torch.Tensor) and a.untyped_storage().nbytes() and \
                    a.untyped_storage().data_ptr() == o.untyped_storage().data_ptr():
                facts.append(f"output {i} shares memory with input {j}")
    return facts


class _Task:
    """The task module with its sizes rebindable per request."""

    def __init__(self, module: Any, device: torch.device,
                 channel: Channel | None = None) -> None:
        self.module = module
        self.device = device
        self.channel = channel
        self.last: tuple[str, Any, list[Any]] | None = None
        # Starts every phase announcing a call into the task's code (see call).
        self.phase = TASK_PHASE
        self.defaults = {k: v for k, v in vars(module).items()
                         if not k.startswith("_") and type(v) in (int, float, bool, tuple, str)}

    def rebind(self, overrides: dict[str, Any]) -> None:
        unknown = sorted(n for n in overrides if not hasattr(self.module, n))
        if unknown:
            raise JobFailure(Failure(
                stage="infrastructure",
                message=unknown_overrides_message(unknown, list(self.defaults))))
        for name, value in self.defaults.items():
            setattr(self.module, name, value)
        for name, value in overrides.items():
            setattr(self.module, name, tuple(value) if isinstance(value, list) else value)

    def call(self, what: str, fn: Any, *args: Any) -> Any:
        if self.channel is not None:
            self.channel.send(Progress(phase=self.phase + what))
        try:
            return fn(*args)
        except JobFailure:
            raise
        except Exception as exc:  # noqa: BLE001 - the task's own code
            stage = "task" if out_of_memory(exc) else "infrastructure"
            raise JobFailure(failure_of(stage, f"the task's {what}", exc,
                                        getattr(self.module, "__file__", ""))) from None
        finally:
            if self.channel is not None:
                self.channel.send(Progress(phase=f"reference harness (after the task's "
                                                 f"{what})"))

    def inputs(self, seed: int, declared: int | None) -> list[Any]:
        seed_all(seed)
        if declared is None:
            return list(self.call("get_inputs()", self.module.get_inputs))
        shapes = self.call("get_inputs_dyn_list()", self.module.get_inputs_dyn_list)
        return list(shapes[declared])

    def init(self) -> list[Any]:
        seed_all(trial_inputs.INIT_SEED)
        return list(self.call("get_init_inputs()", self.module.get_init_inputs))

    def model(self, init: list[Any]) -> Any:
        seed_all(trial_inputs.INIT_SEED)
        device_init = [v.to(self.device) if isinstance(v, torch.Tensor) else v for v in init]
        model = self.call("Model(*get_init_inputs())", self.module.Model, *device_init)
        if isinstance(model, torch.nn.Module):
            model = model.to(self.device)
        return model

    def forward(self, model: Any, args: list[Any]) -> list[torch.Tensor]:
        # Copies: a Model that writes to its inputs must not change the ones sent.
        device_args = [a.to(self.device, copy=True) if isinstance(a, torch.Tensor) else a
                       for a in args]
        with torch.no_grad():
            out = self.call("Model.forward", model, *device_args)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        try:
            outputs = forward_outputs(out, "Model.forward")
        except JobFailure as exc:
            exc.failure.stage = "infrastructure"
            raise
        return outputs, device_args


def _measure(task: _Task, seed: int) -> tuple[int, bool]:
    """Input bytes at ``seed``, on fake tensors when the task allows it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            made = task.inputs(seed, None)
            return sum(t.numel() * t.element_size() for t in made
                       if isinstance(t, torch.Tensor)), True
    except JobFailure:
        raise
    except Exception:  # noqa: BLE001 - fake tensors do not run every task
        made = task.inputs(seed, None)
        return sum(t.numel() * t.element_size() for t in made
                   if isinstance(t, torch.Tensor)), False


def _redraw(task: _Task, model: Any, made: list[Any], seed: int,
            dist: trial_inputs.Distribution) -> tuple[list[Any], list[torch.Tensor], Any,
                                                      str, str | None]:
    """The trial's inputs from ``dist`` (falling back for the task's domain, see
    :mod:`services.worker.inputs`), their outputs, and the distribution used."""
    if dist.kind == "task" or not any(isinstance(v, torch.Tensor) and (
            v.dtype.is_floating_point or v.dtype.is_complex) for v in made):
        outputs, args = task.forward(model, made)
        return made, outputs, args, "task", None
    own_finite: bool | None = None
    for variant, keep_signs in trial_inputs.attempts(dist):
        generator = torch.Generator().manual_seed(seed ^ 0x5DEECE66D)
        redrawn = [trial_inputs.reshape(v, variant, generator, keep_signs)
                   if isinstance(v, torch.Tensor) else v for v in made]
        outputs, args = task.forward(model, redrawn)
        if own_finite is None and trial_inputs.nonfinite(outputs):
            own_outputs, _ = task.forward(model, made)
            own_finite = not trial_inputs.nonfinite(own_outputs)
        if not trial_inputs.nonfinite(outputs) or own_finite is False:
            # Finite, or NaN or Inf on the task's own inputs too: part of the task.
            label = variant.name + (" (signs kept)" if keep_signs else "")
            dropped = ", ".join(trial_inputs.left_out(dist, variant))
            return redrawn, outputs, args, label, (
                f"left out {dropped}: NaN or Inf outputs where the task's own inputs give "
                "none") if dropped else None
    outputs, args = task.forward(model, made)
    return made, outputs, args, "task", (
        f"{dist.name} gives NaN or Inf outputs where the task's own inputs do not; the "
        "task's own distribution was used")


def _answer(task: _Task, channel: Channel, request: RefRequest) -> None:
    task.rebind(dict(request.overrides))
    channel.send(Progress(phase=f"measuring the task's inputs at {request.key} sizes"))
    first_seed = request.trials[0].seed if request.trials else trial_inputs.INIT_SEED
    input_bytes, estimated = _measure(task, first_seed)
    names = size_names(task.module)
    declared_fn = getattr(task.module, "get_inputs_dyn_list", None)
    declared = 0
    if callable(declared_fn) and not request.meta_only:
        with contextlib.suppress(Exception):
            declared = len(list(declared_fn()))
    limit = request.input_limit_bytes
    if limit is not None and input_bytes > limit:
        channel.send(RefSize(key=request.key, input_bytes=input_bytes, estimated=estimated,
                             size_names=names, refused=True))
        return
    if request.meta_only:
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode(allow_non_fake_inputs=True):
            init = task.init()
            made = task.inputs(first_seed, None)
            channel.send(RefMeta(key=request.key,
                                 init=values.encode(init, values.meta_ref),
                                 inputs=values.encode(made, values.meta_ref),
                                 input_bytes=input_bytes, size_names=names))
        return
    init = task.init()
    model = task.model(init)
    encoded, tensors = values.encode_raw(init)
    # The task's own tensors (a mask it builds too): what a candidate may hold computed
    # in __init__ (rule D030); the requested sizes only, where the first call runs.
    state = init_compute.state_digests(model) if request.key == "main" else []
    channel.send(RefSize(key=request.key, input_bytes=input_bytes, estimated=estimated,
                         size_names=names, init=encoded, declared=declared, state=state),
                 tensors)
    task.last = None
    for trial in request.trials:
        channel.send(Progress(phase=f"reference {request.key} trial {trial.index}"))
        made = task.inputs(trial.seed, trial.declared)
        dist = trial_inputs.by_name(trial.distribution)
        if trial.decoy:
            outputs, args = task.forward(model, made)
            used, fallback = "task", None
        else:
            made, outputs, args, used, fallback = _redraw(task, model, made, trial.seed, dist)
        if not trial.decoy:
            task.last = (request.key, model, args)
        encoded, tensors = values.encode_raw(made)
        outputs = [o.detach().to("cpu").contiguous() for o in outputs]
        frame = RefTrial(key=request.key, index=trial.index, decoy=trial.decoy,
                         distribution=used, inputs=encoded,
                         outputs=[_meta(o) for o in outputs],
                         aliasing=_aliasing(outputs, args),
                         inputs_after=[digest(a) for a in args if isinstance(a, torch.Tensor)],
                         fallback=fallback)
        channel.send(frame, tensors + outputs)
    eager = _count_eager(task, model, first_seed) if request.count_eager else None
    channel.send(RefDone(key=request.key, eager=eager))


# Phases of a float64 recheck: not TASK_PHASE, so the worker's task-code watchdog leaves
# them to the worker's own bound on the recheck (whose failure fails nothing).
RECHECK_PHASE = "float64 recheck: " + TASK_PHASE


def _float64_outputs(task: _Task, command: RefRecheck, raws: list[bytearray]
                     ) -> list[torch.Tensor]:
    """The trial's outputs from the task's Model in float64 (CPU tensors).

    Raises:
        JobFailure: the task's code raised, a fresh Model does not reproduce the
            trial's float32 outputs, or an output is not float64 or too large.
    """
    def refuse(message: str) -> JobFailure:
        return JobFailure(Failure(stage="infrastructure", message=message))

    task.rebind(dict(command.overrides))
    made = values.decode_raw(command.inputs, raws)
    init = task.init()
    # Fresh, as the trial's was: a Model that keeps state across calls, or draws
    # random numbers, computes something else now, and nothing is rechecked.
    again, _ = task.forward(task.model(init), made)
    if [digest(o) for o in again] != list(command.digests):
        raise refuse("built afresh, the task's Model does not reproduce the trial's "
                     "float32 outputs (state kept across calls, or random numbers)")
    model = task.model(init)
    if not isinstance(model, torch.nn.Module):
        raise refuse("the task's Model is not a torch.nn.Module (no .double())")
    model = task.call("Model.double()", model.double)
    made = [a.double() if isinstance(a, torch.Tensor) and a.dtype.is_floating_point else a
            for a in made]
    outputs, _ = task.forward(model, made)
    outputs = [o.detach().to("cpu").contiguous() for o in outputs]
    for i, o in enumerate(outputs):
        if o.dtype != torch.float64 and o.dtype.is_floating_point:
            raise refuse(f"output {i} of the task's Model in float64 is {o.dtype}")
        if o.numel() * o.element_size() > command.max_output_bytes:
            raise refuse(f"output {i} in float64 is larger than a frame may be")
    return outputs


def _recheck(task: _Task, channel: Channel, command: RefRecheck,
             raws: list[bytearray]) -> None:
    """Answer a :class:`RefRecheck` with a :class:`RefRechecked` (an error instead of
    outputs when the task's Model cannot run in float64)."""
    channel.send(Progress(phase=f"float64 recheck of {command.key} trial {command.index}"))
    task.phase = RECHECK_PHASE
    try:
        outputs = _float64_outputs(task, command, raws)
    except JobFailure as exc:
        error = exc.failure.message
    except Exception as exc:  # noqa: BLE001 - the recheck only ever keeps a verdict
        error = f"{type(exc).__name__}: {exc}"
    else:
        channel.send(RefRechecked(key=command.key, index=command.index,
                                  outputs=[_meta(o) for o in outputs]), outputs)
        return
    finally:
        task.phase = TASK_PHASE
    channel.send(RefRechecked(key=command.key, index=command.index, error=error))


def _count_eager(task: _Task, model: Any, seed: int) -> EagerCount | None:
    """The task's eager graph at the current sizes, counted on fake tensors (nothing
    computed), or on real inputs when the task does not run on fake tensors; None when
    neither works (the verdict then has no modeled eager time)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from services.worker.traffic import EagerCounter

    task.channel.send(Progress(phase="counting the task's eager graph"))
    for fake in (True, False):
        try:
            with FakeTensorMode(allow_non_fake_inputs=True) if fake else \
                    contextlib.nullcontext():
                made = task.inputs(seed, None)
                # Model.forward alone: not the copies of the inputs task.forward makes.
                with torch.no_grad(), EagerCounter() as counter:
                    task.call("Model.forward", model, *made)
            return counter.count
        except Exception:  # noqa: BLE001 - counting is a model's input, never a verdict
            continue
    return None


def _profile(task: _Task, channel: Channel, spec: ChildSpec, command: RefProfile) -> None:
    """Answer a :class:`RefProfile`: the eager ``Model``, the launch floor, the compiled
    ``Model``, each a :class:`~services.worker.wire.Timing` (see RefProfile)."""
    from services.worker.timing import time_compiled, time_floor, time_forward

    if task.last is None:
        raise JobFailure(Failure(stage="infrastructure", message="harness error: nothing to time"))
    _, model, args = task.last
    if command.eager:
        channel.send(Progress(phase="profiling"))
        channel.send(time_forward(model, args, spec))
    if command.floor:
        channel.send(Progress(phase="profiling"))
        # Under the profiler, as the candidate's timed calls are: the same per-launch cost.
        channel.send(time_floor(spec, profile=profiled_launches))
    if command.compile:
        # Not a task phase: the compile is the harness's, bounded by the worker's own
        # wait (setting profile_compile_timeout_s), and its failure fails nothing.
        channel.send(Progress(phase="compiling the task's Model with torch.compile"))
        channel.send(time_compiled(
            model, args, spec, on_compiled=lambda: channel.send(Progress(phase="profiling"))))


def run_reference_role(spec: ChildSpec, channel: Channel) -> None:
    """Role ``reference`` (registered by services/worker/wire.py): load the task at
    ``spec.task_path``, then :func:`run_reference`.

    Raises:
        JobFailure: the task's module code raised, or it lacks ``Model``,
            ``get_inputs`` or ``get_init_inputs`` (stage ``infrastructure``).
    """
    from services.sandbox.child import load_module

    channel.send(Progress(phase=TASK_PHASE + "module code"))
    try:
        task = load_module("aikg_task", spec.task_path)
    except Exception as exc:
        raise JobFailure(failure_of("infrastructure", "loading the task", exc,
                                    spec.task_path)) from None
    missing = [n for n in REQUIRED_TASK_NAMES if not hasattr(task, n)]
    if missing:
        raise JobFailure(Failure(stage="infrastructure",
                                 message=f"the task does not define {', '.join(missing)}"))
    run_reference(spec, channel, task)


def run_reference(spec: ChildSpec, channel: Channel, module: Any) -> None:
    """Answer the parent's :class:`RefRequest` commands until :class:`Bye`."""
    from services.sandbox.child import device_of

    device = device_of(spec.backend)
    if spec.backend == "cuda":
        # An fp32 reference must be fp32-accurate; TF32 would blur the comparison.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    task = _Task(module, device, channel)
    while True:
        command = channel.recv()
        if command is None or isinstance(command, Bye):
            return
        if isinstance(command, RefProfile):
            _profile(task, channel, spec, command)
            continue
        if isinstance(command, RefRecheck):
            raws = [channel.recv_raw() for _ in values.raw_refs(command.inputs)]
            if any(r is None for r in raws):
                return
            _recheck(task, channel, command, raws)
            continue
        if isinstance(command, RefRequest):
            try:
                _answer(task, channel, command)
            except JobFailure as exc:
                channel.send(RefFailed(key=command.key, stage=exc.failure.stage,
                                       message=exc.failure.message,
                                       traceback=exc.failure.traceback))
