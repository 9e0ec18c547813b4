"""The built-in coder's lowering as a sandbox role: the task's code (module, ``Model``,
``torch.export``) runs only in a sandboxed child.

:func:`run_lower` is the child's side (role ``lower``, registered here with
:func:`services.sandbox.roles.register_role`, with its messages: the child's
:class:`Lowered` answer and the :class:`LowerParams` of its spec);
:func:`lower_in_sandbox` the parent's, used by the generator's built-in coder and the
SDK.

Its row of the sandbox's limits table (:mod:`services.sandbox.limits`) is ``lower``:
settings ``sandbox_lower_address_space_bytes`` (4 GiB) and ``sandbox_lower_cpu_s``
(0: derived from ``lowering_timeout_s``, on one core).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Mapping
from typing import Any

import msgspec

from services.common.settings import LOWERING_TIMEOUT_S
from services.generator.lowering.errors import LoweringError
from services.sandbox import wire
from services.sandbox.channel import EXIT_WAIT_S, describe_exit
from services.sandbox.errors import PoolBroken, ProtocolError
from services.sandbox.pool import Sandbox
from services.sandbox.roles import register_role
from services.sandbox.wire import Channel, ChildSpec, Failure, Progress


class LowerParams(msgspec.Struct, kw_only=True):
    """The lowering child's :attr:`ChildSpec.params
    <services.sandbox.wire.ChildSpec.params>`: the task's ``shape_overrides`` and
    ``launch``, :func:`services.generator.lowering.lower_task`'s keywords
    (``block_size``, ``num_warps``, ``num_stages``: ints; ``arch``: a str)."""

    shape_overrides: dict[str, Any] = {}
    launch: dict[str, int | str] = {}


class Lowered(msgspec.Struct, tag="lowered"):
    """Lowering child -> parent: the built-in coder's candidate source for the task."""

    code: str


register_role("lower", "services.generator.coders.lowering_role:run_lower", frames=(Lowered,))


def run_lower(spec: ChildSpec, channel: Channel) -> None:
    """Role ``lower``, in the child: the built-in coder on the task at
    ``spec.task_path``; sends a Lowered frame, or raises a Failure at stage ``lower``
    whose message says why (the op it cannot lower, the task's own error)."""
    from services.generator.lowering import lower_task
    from services.sandbox.child import JobFailure, failure_of, memory_note, out_of_memory

    channel.send(Progress(phase="lowering the task (running its code, torch.export)"))
    params = msgspec.convert(spec.params, LowerParams)
    with open(spec.task_path, encoding="utf-8") as f:
        task_desc = f.read()

    def progress(phase: str) -> None:
        channel.send(Progress(phase=phase))

    try:
        code = lower_task(task_desc, dict(params.shape_overrides), progress=progress,
                          **params.launch)
    except LoweringError as exc:
        message = str(exc)
        if out_of_memory(exc):
            message += memory_note()
        raise JobFailure(Failure(stage="lower", message=message)) from None
    except Exception as exc:  # noqa: BLE001 - the task's own code may raise anything
        failure = failure_of("lower", "the built-in coder", exc, spec.task_path)
        failure.message = "built-in coder failed: " + failure.message
        raise JobFailure(failure) from None
    channel.send(Lowered(code=code))


async def lower_in_sandbox(sandbox: Sandbox, task_desc: str,
                           shape_overrides: Mapping[str, Any] | None = None,
                           params: Mapping[str, int] | None = None, *,
                           timeout_s: float = LOWERING_TIMEOUT_S,
                           label: str = "lower", limits: Any = None) -> str:
    """The built-in coder's candidate for ``task_desc``, lowered in a sandboxed child.

    The task's module code, ``Model`` construction and ``torch.export`` run only
    there: as the sandbox user, without network, within the ``lower`` row of
    :mod:`services.sandbox.limits` (address space, CPU time), in a fresh
    process killed with its process group after ``timeout_s`` seconds.

    Args:
        params: launch parameters of ``lower_task`` (``block_size``, ``num_warps``,
            ``num_stages``).
        limits: a :class:`services.sandbox.limits.ChildLimits` (default: the
            settings' defaults).

    Returns:
        The candidate's source.

    Raises:
        LoweringError: the task cannot be lowered (the message names the op), its
            code raised, killed the child, hit a limit (named), or outlived
            ``timeout_s`` (the message names the part of the task's code that was
            running).
        PoolBroken: the sandbox is not started or its server is gone.
    """
    from services.sandbox.limits import ChildLimits

    if not sandbox.started:
        raise PoolBroken("the sandbox is not started")
    limits = limits or ChildLimits()
    # The lowering child runs on one core (torch threads 1 on cpu).
    address_space, cpu_seconds, notes = limits.notes("lower", "cpu", timeout_s, cores=1)
    scratch = sandbox.scratch(label, "lower")
    task_path = scratch / "task.py"
    task_path.write_text(task_desc, encoding="utf-8")
    lowering = LowerParams(shape_overrides=dict(shape_overrides or {}), launch=dict(params or {}))
    spec = sandbox.spec("lower", scratch, "lower", task_path=str(task_path),
                        params=msgspec.to_builtins(lowering),
                        cpu_seconds=cpu_seconds, address_space_bytes=address_space,
                        limit_notes=notes)
    run = await sandbox.spawn(spec, 64 << 20)
    phase = ""
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                frame = await run.frame()
                if isinstance(frame, wire.Progress):
                    phase = frame.phase
                    continue
                if isinstance(frame, Lowered):
                    return frame.code
                if isinstance(frame, wire.Failure):
                    raise LoweringError("child", frame.message)
                if frame is None or isinstance(frame, wire.Done):
                    status = await run.wait(EXIT_WAIT_S)
                    tail = " / ".join(run.output(2048).strip().splitlines()[-3:])
                    what = describe_exit(status)
                    if status is not None and os.WIFSIGNALED(status) and \
                            os.WTERMSIG(status) == signal.SIGXCPU:
                        what += f" (the CPU time limit {notes['cpu']})"
                    raise LoweringError(
                        "crash", f"built-in coder's process {what} while running "
                        f"the task's code" + (f": {tail}" if tail else ""))
    except TimeoutError:
        if phase.startswith(wire.TASK_PHASE):
            raise LoweringError(
                "timeout", f"{phase} did not finish in {timeout_s:g} s (setting "
                "AIKG_LOWERING_TIMEOUT_S) while the built-in coder lowered the task; "
                "its process was killed: the task's own code hangs or is far too "
                "slow, fix the task") from None
        raise LoweringError(
            "timeout", f"built-in coder gave up after {timeout_s:g} s (setting "
            f"AIKG_LOWERING_TIMEOUT_S) during {phase or 'its start'}: the task's code did "
            "not finish (check get_inputs()/forward, or shrink it with "
            "shape_overrides)") from None
    except ProtocolError as exc:
        raise LoweringError("protocol",
                           f"built-in coder's process sent a bad answer: {exc}") from None
    finally:
        await run.close()
