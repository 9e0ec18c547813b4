"""Terminal rendering: the live per-island table, the best list, and `aikg list`."""

from __future__ import annotations

from rich.console import Console

from schemas import (
    EvolveCandidate,
    EvolveSummary,
    JobResult,
    JobSubmit,
    Migration,
    VerifyResult,
)
from schemas.events import Traffic
from services.cli.render import event_line, jobs_table, live_view, record_view, verdict_table
from services.common.jobs import new_record


def evolve_record(fitness: str):
    submit = JobSubmit(op_name="relu", task_desc="x", job_type="evolve", max_rounds=3,
                       num_islands=2, job_id="evo-render")
    record = new_record(submit, arch="x86_64")
    record.status = "running"
    cands = [
        EvolveCandidate(candidate_id="c0", island=0, round=0, coder="builtin", code_hash="a",
                        passed=True, speedup=1.5 if fitness == "speedup" else None,
                        modeled_time_us=12.25 if fitness == "modeled_time" else None),
        EvolveCandidate(candidate_id="c1", island=1, round=0, coder="builtin", code_hash="b",
                        passed=False, stage="mismatch"),
        EvolveCandidate(candidate_id="c2", island=1, round=1, coder="builtin", code_hash="c",
                        parent_id="c0", passed=None),
    ]
    record.evolve = EvolveSummary(rounds=3, round=1, fitness=fitness, islands=[["c0"], ["c1", "c2", "c0"]],
                                  elites=["c0"], candidates=cands,
                                  migrations=[Migration(round=0, source_island=0, target_island=1,
                                                        candidate_ids=["c0"])])
    return record


def render(renderable) -> str:
    console = Console(record=True, width=120)
    console.print(renderable)
    return console.export_text()


def test_live_view_shows_a_row_per_island_with_round_passed_and_best_speedup() -> None:
    text = render(live_view(evolve_record("speedup")))
    assert "round 2/3" in text and "1 migration(s)" in text
    assert "best speedup" in text and "1.50x" in text
    rows = [line.split("│") for line in text.splitlines() if line.count("│") >= 6]
    islands = [cells[1].strip() for cells in rows if cells[1].strip().isdigit()]
    assert islands == ["0", "1"]


def test_cpu_evolve_says_speedup_is_not_meaningful_and_lists_best() -> None:
    record = evolve_record("correctness")
    record.status = "completed"
    record.result = JobResult(passed=True, code="class ModelNew: ...", attempts=3,
                              best=[record.evolve.candidates[0]])
    text = render(record_view(record))
    assert "n/a (cpu)" in text
    assert "best candidates" in text and "c0" in text


def test_cpu_evolve_shows_the_best_modeled_time_as_a_model() -> None:
    text = render(live_view(evolve_record("modeled_time")))
    assert "best modeled time" in text and "12.25 us (model)" in text
    assert "best speedup" not in text


def _list_lines(width: int) -> list[str]:
    page = {"jobs": [
        {"job_id": "job-6b64edecba2147378768aa53cbd9cc32", "status": "completed",
         "op_name": "swish_chain", "backend": "cuda", "arch": "h200",
         "submit_time": "2026-11-30T07:50:00Z", "passed": True, "speedup": 4.25},
        {"job_id": "my-job", "status": "failed", "op_name": "matmul", "backend": "cpu",
         "arch": "x86_64", "submit_time": "2026-11-30T07:51:00Z",
         "error": "cannot lower aten.mm.default: the built-in coder handles element-wise "
                  "chains only"}]}
    console = Console(width=width, record=True)
    console.print(jobs_table(page, width))
    return console.export_text().splitlines()


def test_list_keeps_job_ids_whole_on_an_80_column_terminal() -> None:
    lines = _list_lines(80)
    assert all(len(line) <= 80 for line in lines)
    assert any(line.startswith("job-6b64edecba2147378768aa53cbd9cc32  completed") for line in lines)
    assert "passed (4.25x)" in "\n".join(lines)
    # No room for these at 80 columns; `aikg status` has them.
    assert "backend/arch" not in lines[0] and "h200" not in "\n".join(lines)


def test_list_shows_backend_and_submit_time_when_wide() -> None:
    text = "\n".join(_list_lines(160))
    assert "cuda/h200" in text and "2026-11-30 07:51:00" in text
    assert "cannot lower aten.mm.default" in text


def test_list_clips_long_results_at_a_word_with_an_ellipsis() -> None:
    from services.cli.render import _clip

    assert _clip("passed (2.00x)", 160) == "passed (2.00x)"
    long = "cannot lower aten.mm.default: " + "the built-in coder handles chains " * 10
    clipped = _clip(long, 160)
    assert len(clipped) <= 162 and clipped.endswith(" …") and long.startswith(clipped[:-2])
    assert _clip("first line\nTraceback ...", 160) == "first line …"
    text = "\n".join(_list_lines(80))
    assert "aikg status JOB_ID" in text


def test_event_line_shows_a_measured_speedup() -> None:
    line = event_line({"event": "verify_result", "time": "2026-11-30T08:00:00+00:00",
                       "candidate_id": "c3", "verdict": {"passed": True, "speedup": 2.5,
                                                         "gen_time_us": 40.0,
                                                         "base_time_us": 100.0}}).plain
    assert "c3 passed 2.50x (kernel 40.0 us, eager 100.0 us)" in line
    failed = event_line({"event": "verify_result", "candidate_id": "c4",
                         "verdict": {"passed": False, "stage": "mismatch"}}).plain
    assert "c4 failed at mismatch" in failed and "x (" not in failed


def test_a_cpu_verdict_shows_its_counted_traffic_and_modeled_time_as_a_model() -> None:
    verdict = VerifyResult(request_id="r", job_id="j", candidate_id="c", passed=True,
                           worker_id="w", device="0", interpreted=True, duration_s=0.5,
                           traffic=Traffic(bytes_moved=8320, bytes_min=8256,
                                           traffic_ratio=8320 / 8256, launches=1,
                                           model_arch="h100", modeled_time_us=3.0025,
                                           modeled_speedup=1.9996))
    text = render(verdict_table(verdict))
    assert "8,320 bytes moved, 8,256 minimal: ratio 1.01 over 1 launch" in text, text
    assert "3.00 us on h100, speedup 2.00x over eager (above 1: faster) (a model, not a measurement)" in text, text
    # No counted traffic (a GPU verdict, or a failure before the trials): no rows.
    assert "traffic" not in render(verdict_table(VerifyResult(
        request_id="r", job_id="j", candidate_id="c", passed=False, stage="static",
        worker_id="w", device="0", duration_s=0.1)))


def test_the_tolerance_row_states_the_rule() -> None:
    """A max_rel_error above rtol passes where the reference is near 0: the row says why."""
    verdict = VerifyResult(request_id="r", job_id="j", candidate_id="c", passed=True,
                           worker_id="w", device="0", duration_s=0.5, max_abs_error=2e-5,
                           max_rel_error=0.14, atol=1e-4, rtol=1e-4)
    text = render(verdict_table(verdict))
    assert "0.0001 / 0.0001 (each element: |out - ref| <= atol + rtol * |ref|)" in text, text


def test_a_verdict_shows_what_the_gpu_compiler_said_per_kernel_and_target() -> None:
    from schemas.events import CompileFact

    facts = [
        CompileFact(kernel="mm", target="h100", arch="sm_90", config="BLOCK_M=64",
                    registers=96, shared_bytes=16384, occupancy_warps=20, max_warps=64,
                    limiter="registers"),
        CompileFact(kernel="mm", target="h100", arch="sm_90", config="BLOCK_M=256",
                    registers=255, spill_bytes=3944, occupancy_warps=8, max_warps=64,
                    limiter="registers"),
        CompileFact(kernel="mm", target="mi300x", arch="gfx942", ok=False,
                    error="tf32x3 is not supported on gfx942"),
    ]
    v = VerifyResult(request_id="r", job_id="j", candidate_id="c", worker_id="w",
                     device="0", passed=True, interpreted=True, compile_facts=facts)
    console = Console(width=200, record=True)
    console.print(verdict_table(v))
    text = console.export_text()
    # Of each kernel and target the specialisation that fares worst: the spilling one.
    assert "mm on h100 (sm_90): 255 registers, 3944 B spilled" in text
    assert "96 registers" not in text
    assert "mm on mi300x (gfx942): tf32x3 is not supported on gfx942" in text
