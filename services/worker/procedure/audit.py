"""The audit of the candidate's process: what it refused and what it changed.

The planner child reports, at the end of a verification, what the dispatcher, the
audit hook and the thread and process guard refused in the candidate's process (rules
D002, D004, D016) and what its import changed in torch's and triton's namespaces (rule
D017, :mod:`services.worker.rules`); the planner's frames of each call carry the same
refusals. These functions turn them into verdicts (stage ``audit``).
"""

from __future__ import annotations

from services.worker.children import ChildFailed
from services.worker.procedure.outcome import Verdict
from services.worker.procedure.state import RunState


async def audit(state: RunState) -> Verdict | None:
    """The planner's audit frame as a verdict (None: nothing refused or changed; its
    notes and the emulated CUDA calls go to ``state.notes``)."""
    planner = state.planner
    await planner.finish()
    try:
        frame, _ = await planner.get("audit")
    except ChildFailed as exc:
        return state.child_verdict(exc)
    problem = refusals(frame.refused, frame.refused_ops, state.compared) or namespace(
        frame.namespace, state.compared)
    if problem is not None:
        return problem
    state.notes.extend(frame.notes)
    if frame.cuda:
        state.notes.append("cpu backend: CUDA was emulated for the candidate ("
                           + ", ".join(frame.cuda) + "): tensors report cuda:0 and stay "
                           "on the CPU, synchronize returns at once, Event times the host "
                           "clock")
    return None


def refusals(refused: list[str], ops: dict[str, int], compared: int) -> Verdict | None:
    """Rules D002, D004 and D016: what the dispatcher (``ops``: ATen op -> calls), the
    audit hook and the thread and process guard (``refused``) refused in the
    candidate's process; ``compared``: trials compared so far."""
    if ops:
        name, count = max(ops.items(), key=lambda kv: kv[1])
        return Verdict("audit", f"{name} called {count} time{'s' if count != 1 else ''} in "
                       "ModelNew.forward (refused at the dispatcher): PyTorch computed in "
                       "forward; do the work in Triton kernels (only allocation, views "
                       "and layout copies are allowed)",
                       log="\n".join(f"{k}: {v}" for k, v in ops.items()), trials=compared)
    if refused:
        return Verdict("audit", f"the sandbox refused {refused[0]} in candidate code: "
                       "candidates may not inspect the harness, its frames or its file "
                       "descriptors, nor start threads or processes",
                       log="\n".join(refused), trials=compared)
    return None


def namespace(changes: list[str], compared: int) -> Verdict | None:
    """Rule D017: the candidate's import replaced functions of torch or triton."""
    if not changes:
        return None
    return Verdict("audit", f"the candidate's import changed the libraries it is judged "
                   f"with: {', '.join(changes[:3])}"
                   + (f" (+{len(changes) - 3} more)" if len(changes) > 3 else "")
                   + "; candidates must not replace torch's or triton's functions",
                   log="\n".join(changes), trials=compared)
