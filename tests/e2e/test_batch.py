"""Batch verification end to end: the gateway, a real cpu worker (its own sandboxed
verifier) and the SDK, CLI and RemoteWorker on top (services/gateway/batches.py).

Small candidates of tests/helpers.py (relu on 16 x 1024), one trial each: what is
measured is what the batch does (requests sent once per distinct candidate, every
verdict back in the order they finished, cancellation), not how fast.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import msgspec
import pytest

from schemas import VerifyResult, decode, subjects
from services.common.bus import Bus
from services.common.settings import Settings
from services.sdk import RemoteWorker
from services.sdk.client import AIKGClient, AsyncAIKGClient
from tests.conftest import as_role
from tests.helpers import (
    RELU_KERNEL,
    RELU_TASK,
    WRONG_RELU_KERNEL,
    scaled,
    stream_messages,
)

pytestmark = pytest.mark.slow


def variant(kernel: str, i: int) -> str:
    """``kernel`` with a module constant of its own: a distinct AST, the same kernel."""
    return f"{kernel}\nVARIANT = {i}\n"


async def results_of(bus: Bus, batch_id: str) -> list[VerifyResult]:
    """Every result the workers published for the batch, in stream order."""
    return [decode(m, VerifyResult) for m in
            await stream_messages(bus, subjects.job_verdicts(batch_id))]


async def until_verify_is_empty(bus: Bus) -> None:
    """Until the VERIFY stream holds no request (``scaled(30)`` s, then AssertionError)."""
    deadline = asyncio.get_running_loop().time() + scaled(30)
    while True:
        info = await bus.js.stream_info(subjects.STREAM_VERIFY, subjects_filter=">")
        if not info.state.subjects:
            return
        assert asyncio.get_running_loop().time() < deadline, info.state.subjects
        await asyncio.sleep(0.1)


@pytest.mark.timeout(900)
async def test_a_batch_of_50_runs_45_verifications_and_returns_every_verdict_in_finish_order(
        shared_services, settings: Settings, bus: Bus, gateway: str) -> None:
    # 40 distinct passing candidates, 5 distinct failing ones, and 5 copies of passing
    # ones (reformatted: the same AST) paired with their originals: 45 distinct of 50.
    codes = [variant(RELU_KERNEL, i) for i in range(40)]
    codes += [variant(WRONG_RELU_KERNEL, 100 + i) for i in range(5)]
    copies = {45 + k: 3 * k for k in range(5)}
    codes += [codes[original].replace("\n\n\n", "\n\n\n# the same kernel\n")
              for original in copies.values()]
    async with shared_services(settings, bus, generator=False), \
            AsyncAIKGClient(gateway) as client:
        answer = await client.submit_batch("relu", RELU_TASK, codes, trials=1)
        assert (answer["candidates"], answer["unique"]) == (50, 45)
        batch_id = answer["batch_id"]
        streamed = [v async for v in client.stream_batch_verdicts(batch_id)]
        record = await client.get_batch(batch_id)

    results = await results_of(bus, batch_id)
    # 45 verifications ran: one result per distinct candidate's request.
    assert len(results) == 45
    assert sorted(r.request_id for r in results) == sorted(
        {f"{batch_id}-r{copies.get(i, i)}" for i in range(50)})
    # Every candidate has its verdict; copies reuse their original's.
    assert record["status"] == "completed"
    verdicts = {v["index"]: v for v in record["verdicts"]}
    assert sorted(verdicts) == list(range(50))
    assert [i for i in range(50) if not verdicts[i]["passed"]] == list(range(40, 45))
    assert {verdicts[i]["stage"] for i in range(40, 45)} == {"mismatch"}
    for copy, original in copies.items():
        assert verdicts[copy]["duplicate_of"] == original
        assert verdicts[copy]["request_id"] == verdicts[original]["request_id"]
        assert verdicts[copy]["seq"] == verdicts[original]["seq"]
    # In the order they finished: the RESULTS stream's order, each original followed by
    # its copies; the event stream sent the same order.
    order = [v["request_id"] for v in record["verdicts"]]
    assert list(dict.fromkeys(order)) == [r.request_id for r in results]
    seqs = [v["seq"] for v in record["verdicts"]]
    assert seqs == sorted(seqs)
    assert [v["index"] for v in streamed] == [v["index"] for v in record["verdicts"]]
    assert [v["number"] for v in streamed] == list(range(1, 51))
    # Each verification ran its own reference: reference outputs are not shared
    # between verifications (docs/architecture.md, "Buckets and keys").
    assert {r.reference_source for r in results} == {"run"}


async def test_cancel_mid_batch_stops_what_has_not_started_and_the_cli_shows_progress(
        shared_services, settings: Settings, bus: Bus, gateway: str, tmp_path: Path) -> None:
    codes = [variant(RELU_KERNEL, i) for i in range(12)]
    async with shared_services(settings, bus, generator=False), \
            AsyncAIKGClient(gateway) as client:
        batch_id = (await client.submit_batch("relu", RELU_TASK, codes, trials=1))["batch_id"]
        stream = client.stream_batch_verdicts(batch_id)
        first = await asyncio.wait_for(anext(stream), scaled(120))
        assert first["passed"], first
        cancelled = await client.cancel_batch(batch_id)
        assert cancelled["status"] == "cancelled"
        rest = [v async for v in stream]  # ends once nothing more is awaited
        record = await client.get_batch(batch_id)
        taken_back = [c["index"] for c in record["candidates"] if c["cancelled"]]
        assert taken_back, "a worker with one device cannot have started all 12"
        # Every candidate not taken back has its verdict; none taken back has one.
        decided = {v["index"] for v in record["verdicts"]}
        assert decided == set(range(12)) - set(taken_back)
        assert len(rest) + 1 == len(decided)
        # What was taken back is gone from VERIFY: no worker will verify it (the last
        # verification's request goes once the worker acks it, right after its verdict).
        await until_verify_is_empty(bus)

        # The CLI, through the same gateway: progress on stderr, the table on stdout.
        task = tmp_path / "relu.py"
        task.write_text(RELU_TASK)
        paths = []
        for name, code in (("good", RELU_KERNEL), ("same", RELU_KERNEL + "\n# again\n"),
                           ("wrong", WRONG_RELU_KERNEL)):
            paths.append(tmp_path / f"{name}.py")
            paths[-1].write_text(code)
        # An 80-column terminal: the table keeps its passed and stage columns.
        code, out, err = await cli_verify(str(task), *map(str, paths), "--gateway", gateway)
        assert code == 1, (out, err)  # one kernel did not pass
        # One kernel through the gateway: the verdict as a local `aikg verify` shows it.
        one, one_out, one_err = await cli_verify(str(task), str(paths[2]), "--gateway",
                                                 gateway)
    assert "3 kernels, 2 to verify" in err, err
    assert {line.split(": ", 1)[1] for line in err.splitlines() if line.startswith("[")} \
        == {"passed", "failed (mismatch)"}, err
    assert [line.split("]")[0] for line in err.splitlines() if line.startswith("[")] == [
        "[1/3", "[2/3", "[3/3"], err
    assert all(len(line) <= 80 for line in out.splitlines()), out
    assert "2 of 3 kernels passed" in out, out
    header = next(line for line in out.splitlines() if " kernel " in line)
    assert " passed " in header and " stage " in header, out
    wrong_row = next(line for line in out.splitlines() if " wrong.py " in line)
    assert " no " in wrong_row and " mismatch " in wrong_row, out
    assert "#2 wrong.py: output 0:" in out.split("errors:")[1], out  # below the table
    same_row = next(line for line in out.splitlines() if " same.py " in line)
    assert " good.py " in same_row, out  # its verdict is good.py's
    assert one == 1, (one_out, one_err)
    # Titled with the path given (cut at the panel's width), as a local verdict is.
    assert "╭─ verdict: /" in one_out and "verdicts" not in one_out, one_out
    assert "mismatch" in one_out and "output 0:" in one_out, one_out


async def cli_verify(*args: str) -> tuple[int, str, str]:
    """``aikg verify ARGS --trials 1`` on an 80-column terminal."""
    cli = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", "verify", *args, "--trials", "1",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("AIKG_")},
             "COLUMNS": "80"})
    stdout, stderr = await asyncio.wait_for(cli.communicate(), scaled(180))
    return cli.returncode, stdout.decode(), stderr.decode()


async def test_sdk_batch_calls_and_remote_worker_verify_many_send_identical_candidates_once(
        shared_services, settings: Settings, bus: Bus, gateway: str) -> None:
    codes = [RELU_KERNEL, WRONG_RELU_KERNEL, RELU_KERNEL + "\n# the same\n"]
    landed: list[int] = []
    seen: list[dict] = []
    generator = as_role(settings, "generator")  # RemoteWorker acts with its rights
    async with shared_services(settings, bus, generator=False):
        # Through the gateway: the blocking client's wait, the async client's iterator.
        def blocking() -> list:
            with AIKGClient(gateway) as client:
                return client.verify_batch("relu", RELU_TASK, codes, trials=1,
                                           batch_id="sync-batch", on_verdict=seen.append,
                                           timeout=scaled(300))
        by_client = await asyncio.to_thread(blocking)
        async with AsyncAIKGClient(gateway) as client:
            streamed = [v async for v in client.verify_batch_stream(
                "relu", RELU_TASK, codes[::-1], trials=1, batch_id="async-batch")]
        worker = RemoteWorker(settings.nats_url, backend="cpu", settings=generator)
        try:
            verdicts = await worker.verify_many(RELU_TASK, codes, "relu", trials=1,
                                                job_id="sdk-many",
                                                on_verdict=lambda i, _: landed.append(i))
        finally:
            await worker.close()
    assert [v["passed"] for v in by_client] == [True, False, True]
    assert [v["index"] for v in by_client] == [0, 1, 2] and by_client[2]["duplicate_of"] == 0
    assert sorted(v["index"] for v in seen) == [0, 1, 2]
    assert sorted((v["index"], v["passed"]) for v in streamed) == [
        (0, True), (1, False), (2, True)]
    assert len(await results_of(bus, "async-batch")) == 2
    assert [v.passed for v in verdicts] == [True, False, True]
    assert verdicts[2] is verdicts[0] and verdicts[1].stage == "mismatch"
    assert sorted(landed) == [0, 1, 2]
    results = await results_of(bus, "sdk-many")
    assert len(results) == 2 and len({r.request_id for r in results}) == 2
    assert msgspec.structs.asdict(verdicts[0])["job_id"] == "sdk-many"
