"""The fast edit-verify loop of ``aikg verify``: a refusal decided before any sandbox
starts (:func:`verify_kernel`), and ``aikg verify --watch`` (:func:`watch_verify`),
which keeps one warm sandbox and verifies the kernel again on every save.

Where the time of a local verification goes (docs/benchmarks.md, "The edit-verify
loop"): the sandbox's fork server imports torch and triton and probes what confinement
the machine permits (seconds), then the verification itself runs in children forked
from it (about a second for a small kernel on cpu). A single ``aikg verify`` pays both;
``--watch`` pays the first once. A kernel that the worker's static check refuses
(:func:`services.worker.static_check.check_candidate`: pure AST, no torch) needs
neither: its verdict is decided here, from the source, in milliseconds, and it is the
verdict :class:`services.worker.verifier.Verifier` gives it (same request, same
checks, same stage, error and log; ``tests/sandbox/test_early_refusal.py`` compares them).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas import VerifyRequest, VerifyResult
from schemas.events import VerifyPhase
from services.cli.common import ExitCode, err, fail, out, say
from services.cli.phases import LocalPhases
from services.common.task_source import TaskError, check_task
from services.sdk.worker_base import build_request

if TYPE_CHECKING:
    from services.sdk.local_worker import LocalWorker

# How many findings the error line of a static refusal names; the log has them all
# (as services/worker/verifier.py words a static verdict).
SHOWN_FINDINGS = 3


def static_refusal(request: VerifyRequest, *, worker_id: str, device: str,
                   interpreted: bool) -> VerifyResult | None:
    """The verdict of a candidate the worker's static check refuses, decided from its
    source without a sandbox, a child or torch; None when the check finds nothing.

    As :meth:`services.worker.verifier.Verifier.verify` decides it: a syntax error is
    stage ``compile`` (the finding as ``error``), any other finding stage ``static``
    (``static check failed: `` and the first :data:`SHOWN_FINDINGS` findings); ``log``
    holds every finding, one a line; ``phases`` the ``verdict`` span, seconds.

    Args:
        request: the request a worker would get (:func:`services.sdk.worker_base.build_request`).
        worker_id, device: the worker and the device the verdict names (the local
            worker's and its first device, where its verification would have run).
        interpreted: the backend is ``cpu`` (Triton's interpreter).
    """
    from services.worker.static_check import check_candidate

    started = time.monotonic()
    findings = check_candidate(request.code, request.dsl)
    if not findings:
        return None
    text = "\n".join(str(f) for f in findings)
    if findings[0].rule == "syntax":
        stage, error = "compile", str(findings[0])
    else:
        shown = "; ".join(str(f) for f in findings[:SHOWN_FINDINGS])
        more = (f" (+{len(findings) - SHOWN_FINDINGS} more)"
                if len(findings) > SHOWN_FINDINGS else "")
        stage, error = "static", f"static check failed: {shown}{more}"
    return VerifyResult(
        request_id=request.request_id, job_id=request.job_id,
        candidate_id=request.candidate_id, worker_id=worker_id, device=device,
        passed=False, stage=stage, error=error, log=text, interpreted=interpreted,
        duration_s=time.monotonic() - started,
        # The verifier's clock laps "static" only after a clean check: a refusal's time
        # is all "verdict".
        phases={"verdict": round(time.monotonic() - started, 6)})


async def verify_kernel(worker: LocalWorker, task_desc: str, code: str, op_name: str, *,
                        shape_overrides: dict[str, Any] | None = None, trials: int = 3,
                        timeout_s: float = 300.0, allow_unchecked: bool = False,
                        source: str | None = None) -> VerifyResult:
    """``aikg verify``'s verdict of ``code`` on ``worker``: a static refusal decided
    here (:func:`static_refusal`; the worker's sandbox is neither started nor waited
    for, torch is not imported), else ``worker.verify`` with the same arguments
    (``source``: the kernel's file, which the verdict's messages name).

    Raises:
        ValueError: a bad field (as :func:`services.sdk.worker_base.build_request`).
        services.sandbox.pool.PoolBroken: the sandbox cannot start here.
    """
    request = build_request(task_desc, code, op_name, backend=worker.backend,
                            arch=worker.arch or "local", shape_overrides=shape_overrides,
                            timeout_s=timeout_s, trials=trials,
                            allow_unchecked=allow_unchecked, source=source)
    refused = await asyncio.to_thread(
        static_refusal, request, worker_id=worker.worker_id, device=worker.devices[0],
        interpreted=worker.backend == "cpu")
    if refused is not None:
        return refused
    return await worker.verify(task_desc, code, op_name, shape_overrides=shape_overrides,
                               trials=trials, timeout_s=timeout_s,
                               allow_unchecked=allow_unchecked, source=source)


class _Loop:
    """One ``aikg verify --watch``: its files, its warm worker and its runs."""

    def __init__(self, task_file: Path, kernel: Path, worker: LocalWorker, *, op_name: str,
                 overrides: dict[str, Any], trials: int, timeout_s: float,
                 allow_unchecked: bool, as_json: bool,
                 show: Callable[[VerifyResult], None]) -> None:
        self.task_file = task_file
        self.kernel = kernel
        self.worker = worker
        self.op_name = op_name
        self.overrides = overrides
        self.trials = trials
        self.timeout_s = timeout_s
        self.allow_unchecked = allow_unchecked
        self.as_json = as_json
        self.show = show
        self.live = not as_json and err.is_terminal
        self.watched = {task_file.resolve(), kernel.resolve()}
        self.changed = asyncio.Event()
        self.what: set[str] = set()
        # The phases of the run under way, shown as `aikg verify` shows them
        # (services/cli/phases.py); the worker tells them here, between runs to no one.
        self.phases: LocalPhases | None = None
        worker.on_phase = self.phase

    def phase(self, phase: VerifyPhase) -> None:
        """The worker's ``on_phase``: to the run under way, if any."""
        if self.phases is not None:
            self.phases(phase)

    def accepts(self, change: Any, path: str) -> bool:
        """watchfiles' filter: a file of ours written or put in place (an editor that
        saves by renaming a new file over the old one adds it); not its removal."""
        from watchfiles import Change

        return change != Change.deleted and Path(path).resolve() in self.watched

    async def follow(self) -> None:
        """Set :attr:`changed` on every save of the task or the kernel (whatever
        happens meanwhile, a run under way sees one change when it ends)."""
        from watchfiles import awatch

        # The directories, not the files: a save by rename replaces the file watched.
        folders = sorted({str(p.parent) for p in self.watched})
        async for changes in awatch(*folders, watch_filter=self.accepts, recursive=False):
            self.what |= {Path(path).name for _, path in changes}
            self.changed.set()

    async def once(self, run: int, why: str) -> ExitCode:
        """Read both files again and verify; print the verdict. Bad input (a file that
        cannot be read, a task :func:`check_task` refuses) is said and waited out."""
        if not self.as_json:
            out.rule(f"run {run} · {why} · {dt.datetime.now():%H:%M:%S}", style="dim")
        try:
            task_desc = self.task_file.read_text(encoding="utf-8")
            code = self.kernel.read_text(encoding="utf-8")
            check_task(task_desc, self.overrides)
        except (OSError, UnicodeDecodeError) as exc:
            say(f"cannot read {exc.filename or 'a watched file'}: {exc}")
            return ExitCode.USAGE
        except TaskError as exc:
            say(f"{self.task_file}: {exc}")
            return ExitCode.USAGE
        self.phases = LocalPhases(f"run {run}: verifying {self.kernel} ...", self.as_json,
                                  err)
        try:
            with self.phases:
                result = await verify_kernel(
                    self.worker, task_desc, code, self.op_name,
                    shape_overrides=self.overrides, trials=self.trials,
                    timeout_s=self.timeout_s, allow_unchecked=self.allow_unchecked,
                    source=str(self.kernel))
        except ValueError as exc:
            say(str(exc))
            return ExitCode.USAGE
        finally:
            self.phases = None
        self.show(result)
        return ExitCode.OK if result.passed else ExitCode.FAILED

    async def run(self, max_runs: int | None) -> ExitCode:
        """Verify now, then after every save, until ``max_runs`` runs (None: Ctrl-C)."""
        follower = asyncio.ensure_future(self.follow())
        await asyncio.sleep(0)  # the watcher is in place before the first run reads
        warm: asyncio.Future[None] | None = None
        code, run, why = ExitCode.OK, 0, "start"
        try:
            while True:
                run += 1
                code = await self.once(run, why)
                if max_runs is not None and run >= max_runs:
                    return code
                if warm is None:
                    # After the first verdict (a static refusal is not kept waiting for
                    # torch's import), the sandbox warms while the user edits; started
                    # by a full verification already, this does nothing.
                    warm = asyncio.ensure_future(self.worker.start())
                if self.live:
                    say(f"watching {self.kernel} and {self.task_file}: save either to "
                        "verify again; Ctrl-C stops")
                await self.changed.wait()
                if follower.done():
                    follower.result()  # the watcher failed: say why
                why = ", ".join(sorted(self.what)) + " saved"
                self.changed.clear()
                self.what.clear()
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
            if warm is not None:
                if not warm.done():
                    self.worker.abort_start()
                await asyncio.gather(warm, return_exceptions=True)
            await self.worker.close()


def watch_verify(task_file: Path, kernel: Path, *, op_name: str, backend: str,
                 arch: str | None, devices: list[str], overrides: dict[str, Any],
                 trials: int, timeout_s: float, allow_unchecked: bool, as_json: bool,
                 max_runs: int | None, show: Callable[[VerifyResult], None]) -> ExitCode:
    """``aikg verify --watch``: verify ``kernel`` against ``task_file`` now and again on
    every save of either (watchfiles; an editor's save by rename counts), in one warm
    sandbox, showing each verdict with ``show``.

    Each run reads both files again, checks the task (a task that no longer parses, or
    lost a ``--shape`` name, is said on stderr and waited out), and verifies as
    ``aikg verify`` does (:func:`verify_kernel`).

    Returns:
        The last run's exit code (0 passed, 1 not passed, 2 bad input) once
        ``max_runs`` runs are done.

    Raises:
        typer.Exit: 130 on Ctrl-C; 6 when the sandbox cannot start here.
    """
    from services.sdk.local_worker import LocalWorker

    worker = LocalWorker(devices, backend=backend, arch=arch, client_command="aikg verify")
    loop = _Loop(task_file, kernel, worker, op_name=op_name, overrides=overrides,
                 trials=trials, timeout_s=timeout_s, allow_unchecked=allow_unchecked,
                 as_json=as_json, show=show)
    try:
        return asyncio.run(loop.run(max_runs))
    except KeyboardInterrupt:
        fail(ExitCode.INTERRUPTED, "stopped watching")
    except Exception as exc:
        from services.sandbox.pool import PoolBroken

        if not isinstance(exc, PoolBroken):
            raise
        fail(ExitCode.NO_SANDBOX, f"the local sandbox cannot start on this machine: {exc}")
