"""The replayer child: the candidate's kernels run its recorded plan on the real inputs.

It loads the module :func:`services.worker.kernel_source.kernel_module` wrote (the
candidate's ``@triton.jit`` functions and constants, nothing else) and answers each
:class:`~services.worker.wire.ReplayRequest` with the outputs and the inputs as they
are after the call (:class:`~services.worker.wire.Replayed`), or why the plan could not
run (:class:`~services.worker.wire.ReplayFailed`). See :mod:`services.worker.replay`.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch

from services.sandbox import values
from services.sandbox.child import MAX_TRACEBACK_CHARS, JobFailure, clip, device_of, load_module
from services.sandbox.wire import (
    Bye,
    Channel,
    ChildSpec,
    Failure,
    Progress,
    TensorMeta,
    tensor_bytes,
)
from services.worker import enforce
from services.worker.casts import value_changing_cast
from services.worker.harness import candidate_failure
from services.worker.replay import (
    Replayer,
    ReplayError,
    Variant,
    install_bounds_checks,
    resolve_ops,
)
from services.worker.wire import Replayed, ReplayFailed, ReplayRequest

# A replay failure's kind -> the stage of the verdict it fails.
_FAILURE_STAGES = {"trace": "audit", "compute": "audit", "bounds": "runtime",
                   "race": "mismatch", "spin": "mismatch"}


def _meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(dtype=values.dtype_name(t.dtype), shape=list(t.shape),
                      nbytes=t.numel() * t.element_size())


def _kernels(module: Any) -> dict[str, Any]:
    from triton.runtime import interpreter, jit

    return {name: value for name, value in vars(module).items()
            if isinstance(value, (jit.JITFunction, interpreter.InterpretedFunction))}


def _replay(replayer: Replayer, request: ReplayRequest, raws: list[Any]) -> tuple[Any, list]:
    captures = raws[:len(request.captures)]
    real = values.decode_raw(request.real, raws[len(request.captures):])
    for (storage_id, nbytes), data in zip(request.captures, captures, strict=True):
        if len(data) != nbytes:
            raise ReplayError("trace", "a captured storage arrived with the wrong size")
        replayer.add_storage(storage_id, data)
    planned = values.decode(request.inputs, lambda ref: ref)
    planned_refs = values.flat_leaves(planned, values.TensorRef)
    real_tensors = values.flat_tensors(real)
    if len(planned_refs) != len(real_tensors):
        raise ReplayError("trace", f"the plan names {len(planned_refs)} input tensors; the "
                          f"task has {len(real_tensors)}")
    for ref, tensor in zip(planned_refs, real_tensors, strict=True):
        replayer.add_input(ref, tensor)
    # Rule D029: a cast that changes values is compute unless it ends an output.
    cast = value_changing_cast(request.events, request.outputs)
    if cast is not None:
        raise ReplayError("compute", cast)
    replayer.run(request.events, Variant(
        skip_launches=request.skip_launches, config=request.config,
        fill_kind=request.fill_kind, fill_seed=request.fill_seed,
        order_seed=request.order_seed, autotune_runs=request.autotune_runs))
    outputs = replayer.outputs(request.outputs)
    after = [replayer.tensor(ref).detach().to("cpu").contiguous() for ref in planned_refs]
    return outputs, after


def run_replayer(spec: ChildSpec, channel: Channel) -> None:
    """Answer :class:`ReplayRequest` commands until :class:`Bye`."""
    device = device_of(spec.backend)
    # What a plan may run and the checks on it, fixed before any candidate-derived
    # code (the kernel module's decorators and constants) runs.
    ops = resolve_ops()
    bounds = install_bounds_checks() if spec.backend == "cpu" else None
    snapshot = enforce.namespace_snapshot()
    channel.send(Progress(phase="loading the candidate's kernels"))
    module = load_module("aikg_candidate_kernels", spec.candidate_path)
    changes = enforce.namespace_changes(snapshot)
    if changes:
        raise JobFailure(Failure(stage="audit", message=(
            "loading the candidate's kernels changed " + ", ".join(changes[:5])
            + ": a kernel module holds kernels and constants only")))
    kernels = _kernels(module)
    enforce.refuse_threads_and_processes(spec.backend, [])
    replayer = Replayer(kernels, device, bounds, ops)
    while True:
        request = channel.recv()
        if request is None or isinstance(request, Bye):
            return
        if not isinstance(request, ReplayRequest):
            continue
        raws = []
        count = len(request.captures) + len(values.raw_refs(request.real))
        for _ in range(count):
            data = channel.recv_raw()
            if data is None:
                return
            raws.append(data)
        if request.fresh:
            replayer = Replayer(kernels, device, bounds, ops)
        channel.send(Progress(phase=f"replaying {request.key} trial {request.index} "
                                    f"({request.label})"))
        try:
            outputs, after = _replay(replayer, request, raws)
        except ReplayError as exc:
            stage = _FAILURE_STAGES.get(exc.kind, "runtime")
            message = str(exc)
            tb = ""
            if exc.kind == "kernel" and exc.cause is not None:
                failure = candidate_failure("ModelNew.forward", exc.cause,
                                             set(kernels), spec.candidate_path)
                stage, message, tb = failure.stage, failure.message, failure.traceback
            channel.send(ReplayFailed(key=request.key, index=request.index,
                                      label=request.label, kind=exc.kind, stage=stage,
                                      message=message, traceback=tb))
            continue
        except Exception as exc:  # noqa: BLE001 - a malformed plan from the candidate's process
            channel.send(ReplayFailed(
                key=request.key, index=request.index, label=request.label, kind="trace",
                stage="audit", message=f"the plan could not be replayed: "
                                       f"{type(exc).__name__}: {str(exc)[:300]}",
                traceback=clip("".join(traceback.format_exception(exc)),
                               MAX_TRACEBACK_CHARS)))
            continue
        channel.send(Replayed(key=request.key, index=request.index, label=request.label,
                              outputs=[_meta(o) for o in outputs],
                              inputs_after=[_meta(a) for a in after],
                              launches=replayer.launches, traffic=replayer.traffic,
                              captured_bytes=sum(replayer.captured_used.values())),
                     [tensor_bytes(t) for t in outputs + after])
