"""The ``aikg`` commands that talk to a gateway: ``submit``, ``status``, ``kernel``,
``list``, ``cancel``, ``events`` and ``workers`` (``export``: :mod:`services.cli.export`).

Each is a thin shell over :class:`~services.sdk.client.AIKGClient`: it reads its
options, makes the SDK calls inside :func:`~services.cli.common.sdk_errors` (the one
place SDK errors become exit codes) and renders what came back
(:mod:`services.cli.render`). Registered on the app by :mod:`services.cli`.
"""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Annotated, Any

import typer

from schemas import TERMINAL_STATUSES
from services.cli.common import (
    POLL_INTERVAL_S,
    UNREACHABLE_GRACE_S,
    ExitCode,
    GatewayOption,
    JsonOption,
    OpNameOption,
    OutputOption,
    ShapesOption,
    TaskFileArgument,
    TokenOption,
    check_output,
    err,
    fail,
    kernel_source,
    out,
    print_json,
    read_task,
    record_exit,
    record_of,
    say,
    sdk_errors,
    shape_overrides,
    show_record,
    write_kernel,
)
from services.common.settings import GATEWAY_URL
from services.sdk.client import AIKGClient

JobIdArgument = Annotated[str, typer.Argument(metavar="JOB_ID", help="Job id printed by `aikg submit`.")]


def connect(gateway_url: str, token: str | None) -> AIKGClient:
    """The SDK client of the gateway at ``gateway_url``; no ``token``, no auth header
    (the ``--token`` option already read ``AIKG_API_TOKEN``)."""
    return AIKGClient(gateway_url, token=token or "")


def wait_for_job(client: AIKGClient, job_id: str, timeout_s: float, live: bool,
                 follow: str | None) -> dict[str, Any]:
    """The SDK's wait for ``job_id`` (its final status dict), with the job's progress
    on this terminal when ``live`` (under it the phase of the verification under way,
    from the job's events: services/cli/phases.py); errors exit as :func:`sdk_errors`
    says, ``follow`` naming the command that picks the job up again."""
    from services.cli.phases import JobPhases
    from services.cli.render import live_view

    display = (out.status(f"{job_id} submitted", spinner="dots") if live
               else contextlib.nullcontext())
    with display as spinner, sdk_errors(follow):
        view = JobPhases(spinner.update) if spinner else None
        return client.wait_for_completion(
            job_id, timeout=timeout_s, poll_interval=POLL_INTERVAL_S, progress=False,
            on_status=(lambda s: view.status(live_view(record_of(s)))) if view else None,
            on_event=view.event if view else None,
            cancel_on_interrupt=False, unreachable_grace_s=UNREACHABLE_GRACE_S)


def submit(
    file: TaskFileArgument,
    op_name: OpNameOption = None,
    backend: Annotated[str, typer.Option(help="cpu | cuda | ascend.")] = "cpu",
    arch: Annotated[str | None, typer.Option(
        help="Arch (x86_64, h200, a100, ...); default: any with a live worker.")] = None,
    dsl: Annotated[str, typer.Option(help="triton (triton_cuda / triton_ascend accepted).")] = "triton",
    workflow: Annotated[str, typer.Option(
        help="coder_only_workflow | default_workflow.")] = "coder_only_workflow",
    job_type: Annotated[str, typer.Option(help="single | evolve.")] = "single",
    coder: Annotated[str | None, typer.Option(
        help="builtin | llm; default the LLM coder when configured, else builtin.")] = None,
    shape: ShapesOption = None,
    max_rounds: Annotated[int | None, typer.Option(
        help="Evolve rounds; default 1.", show_default=False)] = None,
    parallel_num: Annotated[int | None, typer.Option(
        help="Candidates per evolve round; default 1.", show_default=False)] = None,
    num_islands: Annotated[int | None, typer.Option(
        help="Evolve islands (separate populations); default 1.", show_default=False)] = None,
    migration_interval: Annotated[int | None, typer.Option(
        help="Rounds between migrations of the best candidates to the next island; "
        "default 2.", show_default=False)] = None,
    elite_size: Annotated[int | None, typer.Option(
        help="Best candidates kept in the elite archive across islands; default 5.",
        show_default=False)] = None,
    parent_selection_prob: Annotated[float | None, typer.Option(
        help="Chance that an evolve parent is the island's best rather than a random "
        "passed candidate; default 0.5.", show_default=False)] = None,
    max_attempts: Annotated[int | None, typer.Option(
        help="Candidates a single job may try, repairs included; default 3.",
        show_default=False)] = None,
    job_id: Annotated[str | None, typer.Option(
        help="Client-chosen job id (letters, digits, _ and -); resubmitting the same job "
        "with it is idempotent.")] = None,
    priority: Annotated[str | None, typer.Option(
        help="low | normal | high: order among waiting jobs (high lanes are served "
        "first); the tenant's max_priority bounds it. Default normal.",
        show_default=False)] = None,
    verify_timeout: Annotated[float | None, typer.Option(
        help="Seconds one candidate's verification may take (the job's timeout_s; default "
        "300, or the tenant's max_timeout_s when that is lower).",
        show_default=False)] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Follow the job until it ends.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds --wait waits at most.")] = 1800.0,
    output: OutputOption = None,
    as_json: JsonOption = False,
    gateway_url: GatewayOption = GATEWAY_URL,
    token: TokenOption = None,
) -> None:
    """Submit a task file as a job: print its id, or with --wait follow it to the verdict.

    With --wait and -o FILE the kernel goes to FILE; with --wait and stdout not a
    terminal, the kernel's plain source alone goes to stdout, the verdict to stderr.
    Reads AIKG_GATEWAY_URL and AIKG_API_TOKEN. Exit codes: 0 completed and passed,
    1 failed/cancelled/not passed, 2 bad input or refused (400/401/409/413),
    3 gateway unreachable, 4 --wait timed out, 130 Ctrl-C while waiting.
    """
    task_desc = read_task(file)
    overrides = shape_overrides(file, task_desc, shape)
    if output is not None and not wait:
        fail(ExitCode.USAGE, "-o FILE takes the kernel of a job that ended: add --wait, or "
             "later `aikg kernel JOB_ID -o FILE`")
    check_output(output)
    with connect(gateway_url, token) as client:
        with sdk_errors():
            accepted = client.submit(
                op_name or file.stem, task_desc, job_type=job_type, backend=backend, dsl=dsl,
                workflow=workflow, shape_overrides=overrides, arch=arch, coder=coder,
                job_id=job_id, max_rounds=max_rounds, parallel_num=parallel_num,
                num_islands=num_islands, migration_interval=migration_interval,
                elite_size=elite_size, parent_selection_prob=parent_selection_prob,
                max_attempts=max_attempts, priority=priority, timeout_s=verify_timeout)
        new_id = accepted["job_id"]
        if not wait:
            if as_json:
                sys.stdout.write(json.dumps(accepted) + "\n")
            else:
                out.print(new_id, markup=False)
                err.print(f"follow it: aikg status {new_id} | aikg events {new_id}",
                          markup=False, soft_wrap=True)
            return
        live = not as_json and out.is_terminal
        if live:
            err.print(f"submitted {new_id} to {accepted.get('backend')}/{accepted.get('arch')}",
                      markup=False)
        final = wait_for_job(client, new_id, timeout, live, follow=f"aikg status {new_id}")
    raise typer.Exit(int(show_record(final, as_json, output)))


def status(
    job_id: JobIdArgument,
    output: OutputOption = None,
    as_json: JsonOption = False,
    gateway_url: GatewayOption = GATEWAY_URL,
    token: TokenOption = None,
) -> None:
    """Print a job's record: status, progress, verdict and kernel.

    With -o FILE the kernel goes to FILE; with stdout not a terminal, the kernel's
    plain source alone goes to stdout and the record to stderr.
    Reads AIKG_GATEWAY_URL and AIKG_API_TOKEN. Exit codes: 0 completed and passed,
    1 failed/cancelled/not passed, 2 unknown job, 3 gateway unreachable,
    5 still pending or running.
    """
    check_output(output)
    with connect(gateway_url, token) as client, sdk_errors():
        record = client.get_job_status(job_id)
    raise typer.Exit(int(show_record(record, as_json, output)))


def kernel(
    job_id: JobIdArgument,
    output: OutputOption = None,
    gateway_url: GatewayOption = GATEWAY_URL,
    token: TokenOption = None,
) -> None:
    """Print a job's kernel as plain source (the best verified one), or write it to
    FILE with -o: `aikg kernel JOB_ID > kernel.py`.

    A job that failed has the last candidate it tried: printed with a warning on
    stderr, exit 1. Exit codes: 0 the kernel passed verification, 1 it did not (or the
    job ended without one), 2 unknown job, 3 gateway unreachable, 5 no kernel yet (the
    job is pending or running).
    """
    check_output(output)
    with connect(gateway_url, token) as client, sdk_errors():
        record = record_of(client.get_job_status(job_id))
    result = record.result
    if result is None or not result.code:
        fail(record_exit(record), f"job {job_id} has no kernel " + (
            f"(it ended {record.status}" + (f": {record.error}" if record.error else "") + ")"
            if record.status in TERMINAL_STATUSES
            else f"yet (it is {record.status}; `aikg submit --wait` or `aikg events "
                 f"{job_id}` follows it)"))
    if output is not None:
        write_kernel(output, result.code, result.passed)
    else:
        if not result.passed:
            stage = result.verdict.stage if result.verdict else None
            say(f"job {job_id}'s kernel did NOT pass verification"
                + (f" (stage {stage})" if stage else "") + ": for inspection, not for use")
        sys.stdout.write(kernel_source(result.code))
        sys.stdout.flush()
    raise typer.Exit(int(ExitCode.OK if result.passed else ExitCode.FAILED))


def list_jobs(
    status_filter: Annotated[str | None, typer.Option(
        "--status", help="Only jobs with this status: pending, running, completed, failed, "
        "cancelled, or corrupt (records that do not decode).")] = None,
    op_name: Annotated[str | None, typer.Option(help="Only jobs of this operator.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=500, help="Jobs to show.")] = 20,
    offset: Annotated[int, typer.Option(min=0, help="Newest jobs to skip.")] = 0,
    as_json: JsonOption = False,
    gateway_url: GatewayOption = GATEWAY_URL,
    token: TokenOption = None,
) -> None:
    """List jobs, newest first: id, status, op, backend/arch, submitted, result.

    Exit codes: 0 listed (also when none match), 2 bad option, 3 gateway unreachable.
    """
    with connect(gateway_url, token) as client, sdk_errors():
        page = client.list_jobs(status=status_filter or None, op_name=op_name or None,
                                limit=limit, offset=offset)
    if as_json:
        print_json(page)
        return
    from services.cli.render import jobs_table

    if not page["jobs"]:
        out.print("no jobs" + (" match" if status_filter or op_name else " yet"), markup=False)
        return
    out.print(jobs_table(page, out.width))
    shown = len(page["jobs"])
    if page["total"] > offset + shown:
        err.print(f"{shown} of {page['total']} jobs; more with --offset {offset + shown}",
                  markup=False)


def cancel(
    job_id: JobIdArgument,
    as_json: JsonOption = False,
    gateway_url: GatewayOption = GATEWAY_URL,
    token: TokenOption = None,
) -> None:
    """Cancel a job: the generator stops it, workers skip its pending candidates.

    Exit codes: 0 cancelled, or had already ended (the message says how), 2 unknown
    job, 3 gateway unreachable.
    """
    with connect(gateway_url, token) as client, sdk_errors():
        record = client.cancel_job(job_id)
    if as_json:
        print_json(record)
    elif record["status"] == "cancelled":
        out.print(f"{job_id} cancelled", markup=False)
    else:
        out.print(f"{job_id} had already ended: {record['status']}", markup=False)


def events(
    job_id: JobIdArgument,
    as_json: Annotated[bool, typer.Option(
        "--json", help="One JSON event per line (JobEvent fields plus `seq`).")] = False,
    gateway_url: GatewayOption = GATEWAY_URL,
    token: TokenOption = None,
) -> None:
    """Print a job's events, one line each: its history, then live until it ends.

    Exit codes: 0 the job completed, 1 it failed or was cancelled, 2 unknown job,
    3 gateway unreachable or the stream broke, 130 Ctrl-C (the job goes on).
    """
    from services.cli.render import event_line

    last: str | None = None
    with connect(gateway_url, token) as client, sdk_errors(follow=f"aikg events {job_id}"):
        for event in client.stream_events(job_id):
            last = event.get("event")
            if as_json:
                sys.stdout.write(json.dumps(event) + "\n")
                sys.stdout.flush()
            else:
                out.print(event_line(event), soft_wrap=True)
    if last == "completed":
        raise typer.Exit(int(ExitCode.OK))
    if last in TERMINAL_STATUSES:
        raise typer.Exit(int(ExitCode.FAILED))
    fail(ExitCode.UNREACHABLE, f"the event stream ended before the job did; follow it again: "
         f"`aikg events {job_id}`")


def workers(
    as_json: JsonOption = False,
    gateway_url: GatewayOption = GATEWAY_URL,
    token: TokenOption = None,
) -> None:
    """List live workers: backend/arch, devices, load (in-flight/capacity), leases held.

    Exit codes: 0 listed (also when none is live), 3 gateway unreachable.
    """
    with connect(gateway_url, token) as client, sdk_errors():
        listing = client.get_workers_status()
    if as_json:
        print_json(listing)
        return
    if not listing.get("workers"):
        out.print("no live workers: start one with `aikg worker` (or `aikg up`)", markup=False)
        return
    from services.cli.render import workers_table

    out.print(workers_table(listing))
