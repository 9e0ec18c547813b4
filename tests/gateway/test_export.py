"""``aikg export`` and ``GET /api/v1/kernels`` against a real gateway and nats-server.

Job records are written into the ``jobs`` bucket as a generator leaves them (a
finished job with its kernel and verdict); ``aikg`` runs as a subprocess, and its
files are read back with pyarrow (Parquet) and msgspec (JSON Lines) and compared
with those records.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from schemas import JobRecord, JobResult, JobSubmit, VerifyResult, encode, utcnow
from services.common.bus import Bus
from services.sdk.client import AIKGClient, AIKGHTTPError
from services.sdk.export import read_kernels
from tests.e2e.test_cli import aikg
from tests.helpers import RELU_KERNEL, RELU_TASK

T0 = dt.datetime(2026, 3, 1, 12, 0, tzinfo=dt.UTC)


def finished(job_id: str, *, op_name: str = "relu", passed: bool = True, minute: int = 0,
             coder: str = "llm", model: str | None = "qwen3-coder") -> JobRecord:
    """A job record as the generator leaves it at the end, with a kernel and its verdict."""
    verdict = VerifyResult(
        request_id=f"{job_id}-a1", job_id=job_id, candidate_id=f"{job_id}-c1",
        worker_id="w-1", device="0", passed=passed, stage=None if passed else "mismatch",
        error=None if passed else "output 0 differs", max_abs_error=1e-7, atol=1e-5,
        rtol=1e-5, trials=3, base_time_us=20.0, gen_time_us=10.0, speedup=2.0,
        interpreted=False, duration_s=1.5, baseline_source="shared_cache")
    request = JobSubmit(op_name=op_name, task_desc=RELU_TASK, backend="cuda", arch="h200",
                        shape_overrides={"batch_size": 8}, job_id=job_id)
    return JobRecord(
        job_id=job_id, status="completed" if passed else "failed", job_type="single",
        op_name=op_name, submit_time=T0, backend="cuda", arch="h200", request=request,
        result=JobResult(passed=passed, code=RELU_KERNEL + f"# {job_id}\n", verdict=verdict,
                         candidate_id=f"{job_id}-c1", coder=coder, model=model, attempts=1,
                         speedup=2.0),
        start_time=T0, end_time=T0 + dt.timedelta(minutes=minute))


async def put(bus: Bus, *records: JobRecord) -> None:
    for record in records:
        await bus.jobs.put(record.job_id, encode(record))


def assert_matches(row: dict, record: JobRecord) -> None:
    """An exported row says what the job record says."""
    result, verdict = record.result, record.result.verdict
    assert row["job_id"] == record.job_id and row["candidate_id"] == result.candidate_id
    assert row["op_name"] == record.op_name and row["arch"] == record.arch == "h200"
    assert row["backend"] == record.backend and row["status"] == record.status
    assert row["task_desc"] == record.request.task_desc
    assert row["task_sha256"] == hashlib.sha256(record.request.task_desc.encode()).hexdigest()
    assert json.loads(row["shape_overrides"]) == record.request.shape_overrides
    assert row["code"] == result.code and row["passed"] is result.passed
    assert (row["coder"], row["model"]) == (result.coder, result.model)
    assert row["base_time_us"] == verdict.base_time_us
    assert row["gen_time_us"] == verdict.gen_time_us and row["speedup"] == verdict.speedup
    assert row["worker_id"] == verdict.worker_id and row["trials"] == verdict.trials
    assert row["baseline_source"] == verdict.baseline_source
    assert row["end_time"] == record.end_time and row["submit_time"] == record.submit_time


@pytest.mark.slow  # five `aikg export` processes
async def test_export_round_trips_and_resumes(tmp_path: Path, gateway: str, bus: Bus) -> None:
    records = [finished("job-a", minute=3), finished("job-b", minute=1, coder="builtin",
                                                     model=None),
               finished("job-c", op_name="gelu", minute=2),
               finished("job-failed", passed=False, minute=4)]
    pending = JobRecord(job_id="job-pending", status="pending", job_type="single",
                        op_name="relu", submit_time=utcnow(), backend="cuda", arch="h200",
                        request=JobSubmit(op_name="relu", task_desc=RELU_TASK))
    await put(bus, *records, pending)
    await bus.jobs.put("job-corrupt", b"{not a record")
    env = {"AIKG_GATEWAY_URL": gateway}

    jsonl, parquet = tmp_path / "kernels.jsonl", tmp_path / "kernels.parquet"
    for out in (jsonl, parquet):
        code, stdout, stderr = await aikg("export", str(out), "--page-size", "2", env=env)
        assert code == 0, stderr
        assert "3 kernel(s) written" in stderr and stdout == ""
        # The resume cursor, labelled, on stderr (stdout stays empty).
        cursor = next(line for line in stderr.splitlines() if line.startswith("cursor"))
        assert f"kept in {out}.cursor" in cursor
        assert cursor.rsplit(": ", 1)[1] == json.loads(out.with_name(out.name + ".cursor")
                                                       .read_text())["cursor"]
    # Both files with the mode an open() would give them (the umask's; pytest's: 022).
    assert parquet.stat().st_mode & 0o777 == jsonl.stat().st_mode & 0o777
    # Passed kernels only, in the order their jobs ended.
    by_id = {r.job_id: r for r in records}
    table = pq.read_table(parquet)
    assert table.num_rows == 3 and table.schema.field("end_time").type.tz == "UTC"
    for rows in (read_kernels(jsonl), table.to_pylist()):
        assert [r["job_id"] for r in rows] == ["job-b", "job-c", "job-a"]
        for row in rows:
            assert_matches(row, by_id[row["job_id"]])
    assert read_kernels(jsonl) == table.to_pylist()

    # A job that ends later: --resume adds it, and only it, to both files.
    late = finished("job-late", minute=9)
    await put(bus, late)
    for out in (jsonl, parquet):
        code, _, stderr = await aikg("export", str(out), "--resume", env=env)
        assert code == 0 and "1 kernel(s) written" in stderr, stderr
        rows = read_kernels(out)
        assert [r["job_id"] for r in rows] == ["job-b", "job-c", "job-a", "job-late"]
        assert_matches(rows[-1], late)
    assert parquet.stat().st_mode & 0o777 == jsonl.stat().st_mode & 0o777  # rewritten alike
    code, _, stderr = await aikg("export", str(jsonl), "--resume", env=env)
    assert code == 0 and "0 kernel(s) written" in stderr and len(read_kernels(jsonl)) == 4

    # Filters: --all takes the failed job's kernel too; another filter cannot resume.
    every = tmp_path / "all.jsonl"
    code, _, stderr = await aikg("export", str(every), "--all", "--op-name", "relu", env=env)
    assert code == 0, stderr
    assert [r["job_id"] for r in read_kernels(every)] == ["job-b", "job-a", "job-failed",
                                                          "job-late"]
    code, _, stderr = await aikg("export", str(every), "--resume", env=env)
    assert code == 2 and "filters" in stderr
    code, _, stderr = await aikg("export", str(tmp_path / "kernels.csv"), env=env)
    assert code == 2 and ".jsonl" in stderr and ".parquet" in stderr
    code, _, stderr = await aikg("export", str(tmp_path / "new.jsonl"), "--resume", env=env)
    assert code == 2 and "nothing to resume" in stderr


async def test_kernels_route_pages_by_cursor(gateway: str, bus: Bus) -> None:
    await put(bus, *(finished(f"job-{i}", minute=i) for i in range(5)),
              finished("job-gelu", op_name="gelu", minute=7))
    # The blocking client runs in a thread: the gateway serves in this loop.
    def check() -> None:
        with AIKGClient(gateway) as client:
            pages = list(client.iter_kernel_pages(passed=True, op_name="relu", limit=2))
            assert [len(p["kernels"]) for p in pages] == [2, 2, 1]
            assert [p["more"] for p in pages] == [True, True, False]
            ids = [row["job_id"] for p in pages for row in p["kernels"]]
            assert ids == [f"job-{i}" for i in range(5)]
            # The last cursor is where a later export starts: nothing new yet.
            last = pages[-1]["next_cursor"]
            empty = client.list_kernels(passed=True, op_name="relu", cursor=last)
            assert empty == {"kernels": [], "next_cursor": last, "more": False}
            assert client.list_kernels(passed=False)["kernels"] == []
            with pytest.raises(AIKGHTTPError) as bad:
                client.list_kernels(cursor="not-a-cursor")
            assert bad.value.status_code == 400 and "next_cursor" in bad.value.detail
            with pytest.raises(AIKGHTTPError) as bad:
                client.list_kernels(limit=0)
            assert bad.value.status_code == 400

    await asyncio.to_thread(check)
