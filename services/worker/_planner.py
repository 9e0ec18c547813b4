"""The candidate's own process: it imports ``ModelNew``, builds it, and plans launches
on decoys. Nothing it computes reaches the verdict.

Before the candidate's import: the audit hook, the CUDA emulation (cpu backend), the
launch hooks of :mod:`services.worker.trace`, a snapshot of torch's and triton's
namespaces, the harness's modules hidden. Then the parent's commands:

* :class:`~services.worker.wire.PlanBuild`: ``ModelNew(*init)`` under the init seed,
  on the device (or on ``meta`` for a dry run). Every real model is built before the
  first call: constructors may compute on weights; no input exists yet. Where each
  storage's bytes came from is recorded from before the import on
  (:class:`~services.worker.init_compute.InitRecorder`): a captured storage torch
  computed goes to the parent in ``Traced.init_computed`` (rule D030).
* :class:`~services.worker.wire.PlanDryRun`: ``forward`` on meta inputs at other sizes
  (the task's own): the launches it would make, none run.
* :class:`~services.worker.wire.PlanCall`: the first one arms
  :mod:`services.worker.enforce` (compute refused at the dispatcher, the audit hook
  strict; threads and processes are refused from before the import); then
  ``forward`` on decoys with a ghost
  :class:`~services.worker.trace.TraceRecorder`: the plan, its captured storages and
  the ghost outputs go to the parent (:class:`~services.worker.wire.Traced`).
* :class:`~services.worker.wire.PlanProfile` (GPU): the launches really run, timed,
  the timed calls under ``torch.profiler`` (the kernels they launched go to the
  parent with the timing).

The outputs of ``forward`` must be exactly ``torch.Tensor``, or a plain tuple or list
of them: a subclass or a lazy container would run candidate code after the record.
"""

from __future__ import annotations

from typing import Any

import torch

from services.sandbox import guard as _guard
from services.sandbox import values
from services.sandbox.child import (
    JobFailure,
    device_of,
    failure_of,
    load_module,
    seed_all,
    synchronize,
)
from services.sandbox.wire import (
    Bye,
    Channel,
    ChildSpec,
    Failure,
    Progress,
    TensorMeta,
    tensor_bytes,
)
from services.worker import enforce, init_compute, trace
from services.worker import inputs as trial_inputs
from services.worker.emulation import CudaEmulation
from services.worker.harness import candidate_failure, kernel_names
from services.worker.profiling import profiled_launches
from services.worker.targets import target_for
from services.worker.timing import time_forward
from services.worker.wire import (
    IMPORT_PHASE,
    Audit,
    Built,
    DryRun,
    Imported,
    PlanBuild,
    PlanCall,
    PlanDryRun,
    PlanProfile,
    Traced,
    params_of,
)

_META = torch.device("meta")


def exact_outputs(result: Any) -> list[torch.Tensor]:
    """``forward``'s result as a list of tensors.

    Raises:
        JobFailure: (``audit``) a tensor, tuple or list subclass (its hooks would run
            candidate code after the record); (``mismatch``) anything else.
    """
    kind = type(result)
    items = [result] if kind is torch.Tensor else list(result) if kind in (tuple, list) else None
    if items is not None and all(type(i) is torch.Tensor for i in items):
        return items
    subclass = isinstance(result, (torch.Tensor, tuple, list)) and (
        kind not in (torch.Tensor, tuple, list) or any(
            isinstance(i, torch.Tensor) and type(i) is not torch.Tensor for i in items or ()))
    if subclass:
        odd = kind if kind not in (tuple, list) else next(
            type(i) for i in items if type(i) is not torch.Tensor)
        raise JobFailure(Failure(
            stage="audit",
            message=f"ModelNew.forward returned a {odd.__name__} (not exactly torch.Tensor, "
                    "tuple or list): its methods would run after the record stops; return "
                    "plain tensors that the kernels wrote"))
    if items is None:
        what = f"a {kind.__name__} as output 0"
    else:
        index = next(i for i, item in enumerate(items) if type(item) is not torch.Tensor)
        what = f"a {type(items[index]).__name__} as output {index}"
    raise JobFailure(Failure(stage="mismatch",
                             message=f"ModelNew.forward returned {what}; expected a tensor "
                                     "or a tuple of tensors"))


class _Planner:
    def __init__(self, spec: ChildSpec, channel: Channel, hook: _guard.AuditHook,
                 emulation: CudaEmulation | None, module: Any) -> None:
        self.spec = spec
        self.channel = channel
        self.hook = hook
        self.emulation = emulation
        self.device = device_of(spec.backend)
        self.module = module
        self.model_cls = module.ModelNew
        self.kernels = kernel_names(module)
        self.models: dict[str, Any] = {}
        self.build_errors: dict[str, str] = {}
        self.recorder = trace.TraceRecorder(ghost=True, capture=True)
        self.active: list[trace.TraceRecorder | None] = [None]
        self.armed = False
        self.notes: list[str] = []
        self.last_inputs: dict[str, list[Any]] = {}
        # Where captured storages' bytes came from (rule D030): on from before the import.
        self.init_recorder = init_compute.InitRecorder()

    def fail(self, what: str, exc: BaseException) -> JobFailure:
        with self.hook.harness():
            if isinstance(exc, JobFailure):
                return exc
            compute = str(exc).startswith(trace.REFUSED_PREFIX)
            refused = compute or isinstance(exc, PermissionError) and \
                "the sandbox refused" in str(exc)
            if refused or self.recorder.refused:
                failure = failure_of("audit", what, exc, self.spec.candidate_path)
                if self.recorder.refused:
                    op = max(self.recorder.refused, key=self.recorder.refused.get)
                    where = failure.message.rsplit(" (candidate.py", 1)
                    line = f" (candidate.py{where[1]}" if len(where) == 2 else ""
                    failure.message = (
                        f"{what} called {op}, a PyTorch compute operator, which the sandbox "
                        "refuses once the candidate holds inputs (at the dispatcher, on every "
                        "thread); do the work in Triton kernels (allocation, views and layout "
                        f"copies are allowed){line}")
                return JobFailure(failure)
            if isinstance(exc, trace.TraceError):
                return JobFailure(failure_of("runtime", what, exc, self.spec.candidate_path))
            return JobFailure(candidate_failure(what, exc, self.kernels,
                                                self.spec.candidate_path))

    # ------------------------------------------------------------ commands

    def build(self, command: PlanBuild, raws: list[Any]) -> None:
        if self.armed and not command.meta:
            raise JobFailure(Failure(stage="infrastructure",
                                     message="harness error: a model built after the first call"))
        init = values.decode_raw(command.init, raws)
        seed_all(trial_inputs.INIT_SEED)
        try:
            if command.meta:
                with self._on_meta():
                    model = self.model_cls(*init)
            else:
                init = [v.to(self.device) if isinstance(v, torch.Tensor) else v for v in init]
                self.init_recorder.register_clean(values.flat_tensors(init))
                with self.init_recorder:
                    model = self.model_cls(*init)
                    if isinstance(model, torch.nn.Module):
                        model = model.to(self.device)
                self.init_recorder.retire_dead()
        except Exception as exc:  # noqa: BLE001 - the candidate's constructor
            if command.meta or command.optional:
                with self.hook.harness():
                    error = f"{type(exc).__name__}: {str(exc)[:300]}"
                self.build_errors[command.key] = error
                self.channel.send(Built(key=command.key, error=error))
                return
            raise self.fail("ModelNew(*get_init_inputs())", exc) from None
        self.models[command.key] = model
        self.channel.send(Built(key=command.key))

    def _on_meta(self) -> Any:
        planner = self

        class _Meta:
            def __enter__(self) -> None:
                if planner.emulation is not None:
                    planner.emulation.target = _META
                self.device = torch.device("meta")
                self.device.__enter__()

            def __exit__(self, *exc: object) -> None:
                self.device.__exit__(*exc)
                if planner.emulation is not None:
                    planner.emulation.target = torch.device("cpu")

        return _Meta()

    def dry_run(self, command: PlanDryRun) -> None:
        error = self.build_errors.get(command.key)
        model = self.models.get(command.key)
        if error is not None or model is None:
            self.channel.send(DryRun(key=command.key, error=error or "no model was built"))
            return
        recorder = trace.TraceRecorder(ghost=True, capture=False)
        args = values.decode_raw(command.inputs, [])
        recorder.begin(command.key, 0)
        self.active[0] = recorder
        try:
            with torch.no_grad(), self._on_meta(), recorder:
                model(*args)
            launches = [e for e in recorder.call.events if "launch" in e]
            frame = DryRun(key=command.key, launches=launches)
        except Exception as exc:  # noqa: BLE001 - the candidate's forward on meta tensors
            with self.hook.harness():
                frame = DryRun(key=command.key, error=f"{type(exc).__name__}: {str(exc)[:300]}")
        finally:
            self.active[0] = None
            recorder.end()
        del self.models[command.key]
        self.channel.send(frame)

    def arm(self) -> None:
        if self.armed:
            return
        self.armed = True
        enforce.block_compute(self.spec.backend)
        self.hook.strict()

    def call(self, command: PlanCall, raws: list[Any]) -> None:
        model = self.models.get(command.model)
        if model is None:
            raise JobFailure(Failure(stage="infrastructure",
                                     message=f"harness error: no model {command.model!r}"))
        self.arm()
        decoys = values.decode_raw(command.inputs, raws, self.device)
        where = "" if command.key == "main" else f"{command.key} "
        phase = f"{where}trial {command.index}: ModelNew.forward"
        self.channel.send(Progress(phase=phase))
        recorder = self.recorder
        # The ghost run's fill, from the seed the worker drew for this call (bool
        # allocations constant: see services.worker.trace.Fill).
        recorder.fill = None if command.fill_seed is None else trace.Fill(
            command.fill_kind, command.fill_seed, constant_bool=True)
        record = recorder.begin(command.key, command.index)
        record.inputs = values.encode(decoys, _register(recorder))
        self.active[0] = recorder
        try:
            with torch.no_grad(), recorder:
                result = model(*decoys)
            synchronize(self.spec.backend)
        except Exception as exc:  # noqa: BLE001 - the candidate's forward
            raise self.fail("ModelNew.forward", exc) from None
        finally:
            self.active[0] = None
        outputs = exact_outputs(result)
        del result
        try:
            record.outputs = recorder.encode(outputs if isinstance(outputs, list) else [outputs])
        except (values.ValueError_, trace.TraceError) as exc:
            raise self.fail("ModelNew.forward", exc) from None
        self.last_inputs[command.model] = decoys
        del decoys
        record = recorder.end()
        if record.outputs is None:
            record.outputs = []
        metas = [TensorMeta(dtype=values.dtype_name(o.dtype), shape=list(o.shape),
                            nbytes=o.numel() * o.element_size()) for o in outputs]
        frame = Traced(key=command.key, index=command.index, inputs=record.inputs,
                       events=record.events,
                       captures=[(c.id, len(c.data)) for c in record.captures],
                       outputs=record.outputs, output_metas=metas,
                       refused=list(self.hook.refused), refused_ops=dict(recorder.refused),
                       init_computed=self._init_computed(model, record))
        self.channel.send(frame, [c.data for c in record.captures] + [
            tensor_bytes(o) for o in outputs])

    def _init_computed(self, model: Any, record: trace.CallRecord) -> list[dict[str, Any]]:
        """The captured storages of this call whose bytes torch computed before
        ``forward`` (rule D030, :mod:`services.worker.init_compute`), each named by the
        model's attribute or the module's constant that holds it."""
        if not record.captures:
            return []
        with self.hook.harness():
            names = init_compute.named_tensors([("", model),
                                                (init_compute.MODULE_PREFIX, vars(self.module))])
            found = []
            for capture in record.captures:
                storage = self.recorder.storage_of(capture.id)
                if storage is None:
                    continue
                entry = self.init_recorder.computed(storage, names)
                if entry is not None:
                    found.append({"id": capture.id, **entry})
            return found

    def profile(self, command: PlanProfile) -> None:
        model = self.models.get(command.model)
        args = self.last_inputs.get(command.model)
        if model is None or args is None:
            raise JobFailure(Failure(stage="infrastructure",
                                     message="harness error: nothing to profile"))
        self.channel.send(Progress(phase="profiling"))
        recorder = trace.TraceRecorder(ghost=False, capture=False)
        recorder.begin("profile", 0)
        self.active[0] = recorder
        try:
            with torch.no_grad(), recorder:
                model(*args)
            synchronize(self.spec.backend)
        except Exception as exc:  # noqa: BLE001
            raise self.fail("ModelNew.forward (timed)", exc) from None
        finally:
            self.active[0] = None
        launches = [e for e in recorder.end().events if "launch" in e]
        self.channel.send(DryRun(key="profile", launches=launches))
        try:
            # The timed calls run under torch.profiler: the parent lists and audits the
            # kernels they launched (services/worker/profiling.py).
            self.channel.send(time_forward(model, args, self.spec, profile=profiled_launches,
                                           harness=self.hook.harness))
        except Exception as exc:  # noqa: BLE001
            raise self.fail("timing ModelNew.forward", exc) from None

    def audit(self) -> Audit:
        return Audit(refused=list(self.hook.refused), refused_ops=dict(self.recorder.refused),
                     namespace=[], notes=list(self.notes),
                     cuda=sorted(self.emulation.used) if self.emulation else [])


def _register(recorder: trace.TraceRecorder) -> Any:
    return recorder.register_input


def run_planner(spec: ChildSpec, channel: Channel) -> None:
    """Import the candidate and answer the parent's commands until :class:`Bye`; the
    last frame before Done is the :class:`Audit`."""
    hook = _guard.install_audit_hook(spec.candidate_path)
    emulation = None
    if spec.backend == "cpu" and params_of(spec).emulate_cuda:
        emulation = CudaEmulation(target_for(spec.arch or ""), spec.candidate_path)
        emulation.install()
    active: list[trace.TraceRecorder | None] = [None]
    trace.install_launch_hooks(lambda: active[0])
    snapshot = enforce.namespace_snapshot()
    process_notes = enforce.refuse_threads_and_processes(spec.backend, hook.refused)
    _guard.hide_harness()
    channel.send(Progress(phase=IMPORT_PHASE))
    init_recorder = init_compute.InitRecorder()
    try:
        with init_recorder:
            module = load_module("aikg_candidate", spec.candidate_path)
    except Exception as exc:  # noqa: BLE001 - the candidate's module code
        with hook.harness():
            # A refusal of the sandbox's is what went wrong, not the code's syntax.
            stage = "audit" if hook.refused else "compile"
            raise JobFailure(failure_of(stage, "importing the candidate", exc,
                                        spec.candidate_path)) from None
    if getattr(module, "ModelNew", None) is None:
        raise JobFailure(Failure(stage="static", message="class ModelNew is not defined"))
    changes = enforce.namespace_changes(snapshot)
    channel.send(Imported(namespace=changes, refused=list(hook.refused)))
    planner = _Planner(spec, channel, hook, emulation, module)
    planner.init_recorder = init_recorder
    planner.active = active
    planner.notes.extend(process_notes)
    try:
        _serve(planner, channel)
    except JobFailure:
        raise
    except BaseException as exc:  # noqa: BLE001 - candidate code raising SystemExit ...
        with hook.harness():
            raise JobFailure(failure_of("runtime", "the candidate", exc,
                                        spec.candidate_path)) from None
    finally:
        audit = planner.audit()
        audit.namespace = changes
        channel.send(audit)


def _serve(planner: _Planner, channel: Channel) -> None:
    """The parent's commands, in order, until :class:`Bye` (or its socket closing)."""
    while True:
        command = channel.recv()
        if command is None or isinstance(command, Bye):
            return
        raws = []
        if isinstance(command, (PlanBuild, PlanCall)):
            tree = command.init if isinstance(command, PlanBuild) else command.inputs
            for _ in values.raw_refs(tree):
                data = channel.recv_raw()
                if data is None:
                    return
                raws.append(data)
        if isinstance(command, PlanBuild):
            planner.build(command, raws)
        elif isinstance(command, PlanDryRun):
            planner.dry_run(command)
        elif isinstance(command, PlanCall):
            planner.call(command, raws)
        elif isinstance(command, PlanProfile):
            planner.profile(command)
