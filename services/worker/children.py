"""The worker's side of a sandboxed child's channel: frames read in the background and
handed to whoever waits for them.

A verification talks to three children at once (reference, planner, replayer) and
to each in both directions. :class:`Conversation` reads one child's frames in a task
of its own, reads the raw tensor frames each one announces, validates them, and keys
each answer (``("trial", "main", 0, False)``; a float64 recheck's
``("rechecked", "main", 0)``) so that the verification awaits exactly
the answer it needs (:meth:`Conversation.get`). A :class:`~services.sandbox.wire.Failure`
frame or an early end of the channel fails every waiter with :class:`ChildFailed`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import time
from typing import Any

import torch

from services.sandbox import values
from services.sandbox.channel import EXIT_WAIT_S, ChildRun, describe_exit
from services.sandbox.errors import ForgedFrame, ProtocolError
from services.sandbox.wire import Bye, Done, Failure, Hello, Progress, TensorMeta
from services.worker import wire


class ChildFailed(Exception):
    """A child reported a failure, or its channel ended early. ``stage`` and
    ``message`` as a verdict's; ``who`` names the child (``reference`` ...);
    ``traceback`` the child's."""

    def __init__(self, who: str, stage: str, message: str, traceback: str = "") -> None:
        super().__init__(message)
        self.who = who
        self.stage = stage
        self.message = message
        self.traceback = traceback


def decode_tensor(meta: TensorMeta, data: bytearray) -> torch.Tensor:
    """A CPU tensor from a child's metadata and bytes (both untrusted; validated).

    Raises:
        ProtocolError: the bytes do not fit the metadata.
    """
    try:
        dtype = values.dtype_from_name(meta.dtype)
    except ValueError as exc:
        raise ProtocolError(str(exc)) from None
    if any(d < 0 for d in meta.shape):
        raise ProtocolError(f"negative dimension in shape {meta.shape}")
    numel = math.prod(meta.shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if numel * itemsize != meta.nbytes or len(data) != meta.nbytes:
        raise ProtocolError(f"tensor of shape {meta.shape} and dtype {meta.dtype} "
                            f"cannot hold {len(data)} bytes")
    if numel == 0:
        return torch.empty(meta.shape, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype).reshape(meta.shape)


def _raw_count(frame: Any) -> int:
    if isinstance(frame, wire.RefSize):
        return len(values.raw_refs(frame.init))
    if isinstance(frame, wire.RefTrial):
        return len(values.raw_refs(frame.inputs)) + len(frame.outputs)
    if isinstance(frame, wire.RefRechecked):
        return len(frame.outputs)
    if isinstance(frame, wire.Traced):
        return len(frame.captures) + len(frame.output_metas)
    if isinstance(frame, wire.Replayed):
        return len(frame.outputs) + len(frame.inputs_after)
    return 0


def _key(frame: Any) -> tuple | None:
    if isinstance(frame, wire.RefSize):
        return ("size", frame.key)
    if isinstance(frame, wire.RefMeta):
        return ("meta", frame.key)
    if isinstance(frame, wire.RefTrial):
        return ("trial", frame.key, frame.index, frame.decoy)
    if isinstance(frame, wire.RefDone):
        return ("done", frame.key)
    if isinstance(frame, wire.RefRechecked):
        return ("rechecked", frame.key, frame.index)
    if isinstance(frame, wire.Built):
        return ("built", frame.key)
    if isinstance(frame, wire.DryRun):
        return ("dry", frame.key)
    if isinstance(frame, wire.Traced):
        return ("traced", frame.key, frame.index)
    if isinstance(frame, (wire.Replayed, wire.ReplayFailed)):
        return ("replay", frame.key, frame.index, frame.label)
    if isinstance(frame, wire.Audit):
        return ("audit",)
    if isinstance(frame, wire.Imported):
        return ("imported",)
    if isinstance(frame, wire.Timing):
        return ("timing",) if not frame.label else ("timing", frame.label)
    if isinstance(frame, wire.Compiled):
        return ("compiled",)
    return None


class Conversation:
    """One child: its run, a reader task, and the answers it sent so far.

    Args:
        who: the child's role, for messages (``reference``, ``candidate`` ...).
        run: the spawned child.
        lost_stage: the stage of an early end (``crash`` for candidate code,
            ``infrastructure`` for the reference).
    """

    def __init__(self, who: str, run: ChildRun, lost_stage: str) -> None:
        self.who = who
        self.run = run
        self.lost_stage = lost_stage
        self.phase = "starting"
        self.phase_since = time.monotonic()
        # Commands sent that expect an answer, minus answers received: a child with
        # work outstanding is one that can be blamed for a timeout.
        self.outstanding = 0
        self.profiling_at: float | None = None
        self.started = time.monotonic()
        self.ended: float | None = None
        self._answers: dict[tuple, Any] = {}
        self._key_failures: dict[str, ChildFailed] = {}
        self._waiters: dict[tuple, asyncio.Future] = {}
        self.failure: ChildFailed | None = None
        self.done = asyncio.get_running_loop().create_future()
        self._reader = asyncio.ensure_future(self._read())
        # Commands posted (see post): written in order by one task, so that whoever
        # posts goes on while the child is still busy with an earlier command.
        self._posted: asyncio.Queue | None = None
        self._writer: asyncio.Task | None = None

    @property
    def seconds(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    async def _read(self) -> None:
        try:
            while True:
                frame = await self.run.frame()
                if frame is None:
                    status = await self.run.wait(EXIT_WAIT_S)
                    raise self._lost(status)
                if isinstance(frame, Progress):
                    self.phase = frame.phase
                    self.phase_since = time.monotonic()
                    if frame.phase == "profiling":
                        self.profiling_at = time.monotonic()
                    continue
                if isinstance(frame, Hello):
                    continue
                if isinstance(frame, Failure):
                    raise ChildFailed(self.who, frame.stage, frame.message, frame.traceback)
                if isinstance(frame, Done):
                    break
                raws = []
                for _ in range(_raw_count(frame)):
                    data = await self.run.raw_any()
                    if data is None:
                        status = await self.run.wait(EXIT_WAIT_S)
                        raise self._lost(status)
                    raws.append(data)
                if isinstance(frame, wire.RefFailed):
                    self._fail_key(frame.key, ChildFailed(self.who, frame.stage, frame.message,
                                                          frame.traceback))
                    continue
                key = _key(frame)
                if key is None:
                    raise ProtocolError(f"an unexpected {type(frame).__name__} frame")
                self._deliver(key, (frame, raws))
        except ForgedFrame as exc:
            self._fail(ChildFailed(self.who, "audit", f"the {self.who}'s process wrote on the "
                                   f"result channel during {self.phase}: {exc}; candidates "
                                   "must not touch the harness's file descriptors"))
        except ProtocolError as exc:
            self._fail(ChildFailed(self.who, self.lost_stage,
                                   f"the {self.who}'s process sent malformed frames: {exc}"))
        except ChildFailed as exc:
            self._fail(exc)
        except asyncio.CancelledError:
            self._fail(ChildFailed(self.who, "infrastructure", f"the {self.who} was stopped"))
            raise
        except Exception as exc:  # noqa: BLE001 - whatever the socket does
            self._fail(ChildFailed(self.who, "infrastructure",
                                   f"reading the {self.who}'s frames: {type(exc).__name__}: {exc}"))
        finally:
            self.ended = time.monotonic()
            if not self.done.done():
                self.done.set_result(None)

    def _lost(self, status: int | None) -> ChildFailed:
        if status is None:
            return ChildFailed(self.who, "infrastructure",
                               f"the sandbox server went away during {self.phase}")
        what = describe_exit(status)
        cpu = self.run.spec.limit_notes.get("cpu")
        if cpu and os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGXCPU:
            what += f" (the CPU time limit {cpu})"
        if what.startswith("killed"):
            what = f"was {what}"
        if os.WIFEXITED(status):
            what += " before returning results (does the candidate call os._exit or sys.exit?)"
        return ChildFailed(self.who, self.lost_stage,
                           f"the {self.who}'s process {what} during {self.phase}")

    def _deliver(self, key: tuple, item: Any) -> None:
        self.outstanding = max(0, self.outstanding - 1)
        waiter = self._waiters.pop(key, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(item)
        else:
            self._answers[key] = item

    def _fail_key(self, name: str, failure: ChildFailed) -> None:
        """Every answer about sizes ``name`` fails (the child goes on)."""
        self._key_failures[name] = failure
        for key in [k for k in self._waiters if len(k) > 1 and k[1] == name]:
            waiter = self._waiters.pop(key)
            if not waiter.done():
                waiter.set_exception(failure)

    def forget(self, name: str) -> None:
        """Drop what is known about sizes ``name`` (before asking about them again)."""
        self._key_failures.pop(name, None)
        for key in [k for k in self._answers if len(k) > 1 and k[1] == name]:
            del self._answers[key]

    def _fail(self, failure: ChildFailed) -> None:
        if self.failure is None:
            self.failure = failure
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_exception(self.failure)
        self._waiters.clear()

    async def get(self, *key: Any) -> tuple[Any, list[bytearray]]:
        """The answer keyed ``key`` (frame, raw frames), once it arrives.

        Raises:
            ChildFailed: the child failed (or ended) before sending it.
        """
        if key in self._answers:
            return self._answers.pop(key)
        if len(key) > 1 and key[1] in self._key_failures:
            raise self._key_failures[key[1]]
        if self.failure is not None:
            raise self.failure
        waiter = asyncio.get_running_loop().create_future()
        self._waiters[key] = waiter
        return await waiter

    async def peek(self, *key: Any) -> tuple[Any, list[bytearray]]:
        """Like :meth:`get`, but the answer stays for the next :meth:`get` of ``key``.

        Raises:
            ChildFailed: the child failed (or ended) before sending it.
        """
        answer = await self.get(*key)
        self._answers[key] = answer
        return answer

    async def send(self, command: Any, raws: list[Any] = (), answers: int = 1) -> None:
        """Send a command (``answers``: how many keyed answers it asks for); a child that
        is gone fails the send with its own failure."""
        self.outstanding += answers
        try:
            await self.run.send(command, raws)
        except (ConnectionError, OSError):
            await asyncio.wait({self.done}, timeout=EXIT_WAIT_S)
            raise self.failure or ChildFailed(self.who, self.lost_stage,
                                              f"the {self.who}'s process closed its channel "
                                              f"during {self.phase}") from None

    def post(self, command: Any, raws: list[Any] = (), answers: int = 1) -> None:
        """Queue a command for the child without waiting for it to be written: a busy
        child reads its socket only between commands, so :meth:`send` of a large one
        waits for it. Commands posted are written in order, after those posted before;
        a write that fails fails the child's waiters (:meth:`get` raises ChildFailed)."""
        if self._posted is None:
            self._posted = asyncio.Queue()
            self._writer = asyncio.ensure_future(self._write_posted())
        self._posted.put_nowait((command, raws, answers))

    async def _write_posted(self) -> None:
        while True:
            command, raws, answers = await self._posted.get()
            try:
                await self.send(command, raws, answers)
            except ChildFailed as exc:
                self._fail(exc)
                return

    async def finish(self, timeout: float = 30.0) -> None:
        """Say Bye (after the commands posted) and wait for the child's Done (or its end)."""
        with contextlib.suppress(ChildFailed):
            if self.failure is None and self._posted is not None:
                self.post(Bye())
            elif self.failure is None:
                await self.send(Bye())
        await asyncio.wait({self.done}, timeout=timeout)

    async def close(self) -> None:
        """Kill the child and end the reader and the writer of posted commands (cleanup
        runs to its end, see ChildRun.close)."""
        self.run.kill()
        await self.run.close()
        for task in (self._reader, self._writer):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
