"""``aikg run`` and ``aikg verify``: write and verify a kernel, or verify your own, on
this machine (no NATS, no network), in the sandbox a worker uses; ``verify`` of several
kernels, or through ``--gateway``, is a batch (:mod:`services.cli.batch`). Registered
on the app by :mod:`services.cli`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import msgspec
import typer

from services.cli.common import (
    ArchOption,
    BackendOption,
    DevicesOption,
    ExitCode,
    JsonOption,
    OpNameOption,
    OutputOption,
    ShapesOption,
    TaskFileArgument,
    TimeoutOption,
    TokenOption,
    TrialsOption,
    check_output,
    err,
    fail,
    local_inputs,
    out,
    read_task,
    run_locally,
    show_with_kernel,
)
from services.cli.phases import LocalPhases


async def _run_local(task_desc: str, op_name: str, backend: str, arch: str | None,
                     devices: list[str], shape_overrides: dict[str, Any], trials: int,
                     timeout_s: float, on_phase: Any = None
                     ) -> tuple[str, bool, dict[str, Any]]:
    from services.sdk import LocalWorker, Task, WorkerManager

    manager = WorkerManager()
    worker = LocalWorker(devices, backend=backend, arch=arch, client_command="aikg run",
                         on_phase=on_phase)
    manager.add(worker, backend, worker.arch, len(devices))
    try:
        return await Task(op_name, task_desc, task_id=f"run-{os.getpid()}", backend=backend,
                          arch=worker.arch, shape_overrides=shape_overrides, trials=trials,
                          timeout_s=timeout_s, worker_manager=manager,
                          on_phase=on_phase).run()
    finally:
        await worker.close()


def run(
    file: TaskFileArgument,
    op_name: OpNameOption = None,
    backend: BackendOption = "cpu",
    arch: ArchOption = None,
    devices: DevicesOption = "0",
    shape: ShapesOption = None,
    trials: TrialsOption = 3,
    timeout: TimeoutOption = 300.0,
    output: OutputOption = None,
    as_json: JsonOption = False,
) -> None:
    """Write a kernel for FILE with the built-in coder and verify it on this machine.

    Local mode: no NATS, no gateway, no network. The task's code and the candidate run
    only in sandboxed child processes (README, "Security model"). Prints the verdict and the kernel;
    -o FILE writes the kernel to FILE, and with stdout not a terminal (`> kernel.py`)
    the kernel's plain source alone goes to stdout, the verdict to stderr.
    Exit codes: 0 passed, 1 not passed or no kernel for this task, 2 bad input, 6 the
    sandbox cannot start here, 130 Ctrl-C.
    """
    task_desc, device_list, overrides = local_inputs(file, backend, devices, shape)
    check_output(output)
    what = f"writing and verifying a kernel for {file} on {backend} ..."
    phases = LocalPhases(what, as_json, err)
    op, passed, info = run_locally(
        what, as_json,
        _run_local(task_desc, op_name or file.stem, backend, arch, device_list, overrides,
                   trials, timeout, on_phase=phases), display=phases)
    from services.cli.render import local_result_view

    show_with_kernel(lambda kernel: local_result_view(op, passed, info, kernel=kernel),
                     info.get("code"), passed, output,
                     {"op_name": op, **info} if as_json else None)
    raise typer.Exit(int(ExitCode.OK if passed else ExitCode.FAILED))


async def _verify_local(task_desc: str, code: str, op_name: str, backend: str,
                        arch: str | None, devices: list[str], shape_overrides: dict[str, Any],
                        trials: int, timeout_s: float, allow_unchecked: bool = False,
                        source: str | None = None, on_phase: Any = None) -> Any:
    from services.cli.watch import verify_kernel
    from services.sdk import LocalWorker

    worker = LocalWorker(devices, backend=backend, arch=arch, client_command="aikg verify",
                         on_phase=on_phase)
    try:  # a static refusal is decided before the sandbox starts (services/cli/watch.py)
        return await verify_kernel(worker, task_desc, code, op_name,
                                   shape_overrides=shape_overrides, trials=trials,
                                   timeout_s=timeout_s, allow_unchecked=allow_unchecked,
                                   source=source)
    finally:
        await worker.close()


def verify(
    file: TaskFileArgument,
    kernels: Annotated[list[Path], typer.Argument(
        exists=True, dir_okay=False, readable=True, metavar="KERNEL",
        help="Your candidates: Python defining class ModelNew (Triton kernels launched "
             "from forward); more than one is a batch.")],
    op_name: OpNameOption = None,
    backend: BackendOption = "cpu",
    arch: ArchOption = None,
    devices: DevicesOption = "0",
    shape: ShapesOption = None,
    trials: TrialsOption = 3,
    timeout: TimeoutOption = 300.0,
    gateway_url: Annotated[str | None, typer.Option(
        "--gateway", show_default=False,
        help="Verify on the AIKG workers behind this gateway (one batch verification) "
             "instead of on this machine.")] = None,
    token: TokenOption = None,
    as_json: JsonOption = False,
    allow_unchecked: Annotated[bool, typer.Option(
        "--allow-unchecked",
        help="Accept a partial check: pass even where what the task's own sizes launch "
             "was not checked (the verdict then says so, stage 'unchecked').")] = False,
    watch: Annotated[bool, typer.Option(
        "--watch",
        help="Verify again on every save of KERNEL or FILE, in one warm sandbox (a "
             "second verdict in about a second), until Ctrl-C; one kernel, local.")] = False,
    max_runs: Annotated[int | None, typer.Option(
        "--max-runs", min=1, show_default=False,
        help="With --watch: stop after this many verifications (the first included) "
             "and exit with the last one's code.")] = None,
) -> None:
    """Verify KERNEL (your own ModelNew) against FILE's Model on this machine.

    The same checks a worker runs (docs/verification.md), in the same sandbox; no
    NATS, no network. Prints the verdict: the stage and message of a failure, errors,
    sizes checked. With several kernels (a batch), identical ones are verified once,
    progress goes to stderr and a table of verdicts to stdout; with --gateway the
    batch runs on the gateway's workers. Exit codes: 0 passed (every kernel), 1 not
    passed, 2 bad input, 3 gateway unreachable, 6 the sandbox cannot start here, 130
    Ctrl-C. A kernel the static check refuses is answered from its source, before any
    sandbox starts. With --watch the kernel is verified again on every save (README,
    "The edit-verify loop"); --max-runs N stops after N verdicts.
    """
    if watch and (len(kernels) > 1 or gateway_url):
        fail(ExitCode.USAGE, "--watch verifies one kernel on this machine: give one "
             "KERNEL and no --gateway")
    if max_runs is not None and not watch:
        fail(ExitCode.USAGE, "--max-runs goes with --watch")
    if len(kernels) > 1 or gateway_url:
        _verify_batch(file, kernels, op_name or file.stem, backend, arch, devices, shape,
                      trials, timeout, gateway_url, token, as_json, allow_unchecked)
    task_desc, device_list, overrides = local_inputs(file, backend, devices, shape)
    kernel = kernels[0]

    def show(result: Any) -> None:
        if as_json:
            sys.stdout.write(json.dumps(msgspec.to_builtins(result)) + "\n")
            sys.stdout.flush()
        else:
            from services.cli.render import verdict_panel

            out.print(verdict_panel(result, f"verdict: {kernel}"))

    if watch:
        from services.cli.watch import watch_verify

        raise typer.Exit(int(watch_verify(
            file, kernel, op_name=op_name or file.stem, backend=backend, arch=arch,
            devices=device_list, overrides=overrides, trials=trials, timeout_s=timeout,
            allow_unchecked=allow_unchecked, as_json=as_json, max_runs=max_runs,
            show=show)))
    code = read_task(kernel)
    what = f"verifying {kernel} against {file} on {backend} ..."
    phases = LocalPhases(what, as_json, err)
    result = run_locally(
        what, as_json,
        _verify_local(task_desc, code, op_name or file.stem, backend, arch, device_list,
                      overrides, trials, timeout, allow_unchecked, source=str(kernel),
                      on_phase=phases),
        display=phases)
    show(result)
    raise typer.Exit(int(ExitCode.OK if result.passed else ExitCode.FAILED))


def _verify_batch(file: Path, kernels: list[Path], op_name: str, backend: str,
                  arch: str | None, devices: str, shape: list[str] | None, trials: int,
                  timeout: float, gateway_url: str | None, token: str | None,
                  as_json: bool, allow_unchecked: bool = False) -> None:
    """``aikg verify`` of several kernels, or of any through ``--gateway``
    (:mod:`services.cli.batch`); exits with the batch's code."""
    from services.cli import batch as cli_batch

    task_desc, device_list, overrides = local_inputs(file, backend, devices, shape)
    codes = [read_task(k) for k in kernels]
    names = [str(k) for k in kernels]
    live = not as_json and err.is_terminal
    where = f"the workers of {gateway_url}" if gateway_url else backend
    what = f"verifying {len(kernels)} kernels against {file} on {where}"
    with cli_batch.progress(len(kernels), what, live) as tick:
        if gateway_url:
            try:
                verdicts = cli_batch.gateway_batch(
                    gateway_url, token, task_desc=task_desc, codes=codes, names=names,
                    op_name=op_name, backend=backend, arch=arch, shape_overrides=overrides,
                    trials=trials, timeout_s=timeout, tick=tick,
                    allow_unchecked=allow_unchecked)
            except KeyboardInterrupt:
                fail(ExitCode.INTERRUPTED, "stopped; the batch was cancelled")
        else:
            verdicts = run_locally(what, True, cli_batch.verify_locally(
                task_desc, codes, names, op_name, backend=backend, arch=arch,
                devices=device_list, shape_overrides=overrides, trials=trials,
                timeout_s=timeout, tick=tick, allow_unchecked=allow_unchecked))
    raise typer.Exit(int(cli_batch.report(names, verdicts, as_json)))

