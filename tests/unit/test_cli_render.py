"""Terminal rendering: the live per-island table, the best list, and `aikg list`."""

from __future__ import annotations

import msgspec
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


def bf16_pass(**fields) -> VerifyResult:
    """A passing bf16 verdict whose max_rel_error alarms on its own (an element near 0)."""
    body = dict(request_id="r", job_id="j", candidate_id="c", passed=True, worker_id="w",
                device="0", duration_s=0.5, max_abs_error=0.0156, max_rel_error=20.3,
                rel_l2_error=0.004, atol=0.02, rtol=0.02, trials=3, interpreted=True)
    return VerifyResult(**{**body, **fields})


def test_a_pass_shows_rel_l2_beside_max_errors_and_says_which_rule_decided_it() -> None:
    text = render(verdict_table(bf16_pass()))
    assert "max_rel_error  20.3" in text and "rel_l2_error   0.004 (bound 0.1: 5 x rtol)" in text
    assert ("passed by      max rel 20.3 > rtol 0.02 only where |ref| is small (atol decides "
            "there); rel-L2 0.004 <= 0.1") in text, text
    # Errors all within rtol: said so, with the figures.
    text = render(verdict_table(bf16_pass(max_rel_error=0.001)))
    assert "every element within rtol (max rel 0.001 <= 0.02); rel-L2 0.004 <= 0.1" in text
    # Above 5 x rtol, the pass came from the float64 recheck's widened bound.
    assert "widened bound" in render(verdict_table(bf16_pass(rel_l2_error=0.3)))
    # A failure is explained by its own error, not by this line.
    assert "passed by" not in render(verdict_table(bf16_pass(passed=False, stage="mismatch")))


def test_the_rel_l2_factor_is_the_workers() -> None:
    from services.cli.render import REL_L2_FACTOR
    from services.worker.tolerances import REL_L2_FACTOR as WORKER_FACTOR

    assert REL_L2_FACTOR == WORKER_FACTOR


def test_short_ids_leave_out_the_shared_prefix_else_keep_unique_ends() -> None:
    from services.cli.render import short_ids

    names, prefix = short_ids(["job-abc-c1", "job-abc-c10", "job-abc-c2"])
    assert prefix == "job-abc-" and names == {"job-abc-c1": "c1", "job-abc-c10": "c10",
                                              "job-abc-c2": "c2"}
    assert short_ids(["job-abc-c0"]) == ({"job-abc-c0": "c0"}, "job-abc-")
    names, prefix = short_ids(["alpha_0123456789", "beta_0123456780"])
    assert prefix == "" and names == {"alpha_0123456789": "…23456789",
                                      "beta_0123456780": "…23456780"}


def modeled_evolve_record():
    """A finished cpu evolve job with real-length ids, ranked by modeled time."""
    jid = "job-6b64edecba2147378768aa53cbd9cc32"
    submit = JobSubmit(op_name="relu", task_desc="x", job_type="evolve", max_rounds=3,
                       num_islands=2, job_id=jid)
    record = new_record(submit, arch="x86_64")
    record.status = "completed"
    blocks, warps = [1024, 256, 512, 2048], [4, 8, 4, 2]
    cands = [EvolveCandidate(
        candidate_id=f"{jid}-c{i}", island=i % 2, round=i // 2, coder="builtin",
        code_hash=str(i), parent_id=f"{jid}-c{i - 2}" if i >= 2 else None,
        params={"block_size": blocks[i], "num_warps": warps[i], "num_stages": 1},
        passed=i != 3, stage="mismatch" if i == 3 else None,
        modeled_time_us=None if i == 3 else 3.16 + i / 10,
        modeled_speedup=None if i == 3 else 1.9 - i / 20) for i in range(4)]
    record.evolve = EvolveSummary(rounds=3, round=1, fitness="modeled_time",
                                  islands=[[c.candidate_id for c in cands if c.island == k]
                                           for k in (0, 1)], candidates=cands)
    record.result = JobResult(passed=True, code="class ModelNew: ...", attempts=4,
                              best=[cands[0], cands[2], cands[1]])
    return record


def test_cpu_evolve_shows_each_candidates_changed_params_and_modeled_time_and_speedup() -> None:
    console = Console(width=80, record=True)
    console.print(record_view(modeled_evolve_record(), kernel=False))
    text = console.export_text()
    assert all(len(line) <= 80 for line in text.splitlines())
    rows = {line.split()[0]: line for line in text.split("best candidates")[0].splitlines()
            if line[:2] in ("c0", "c1", "c2", "c3")}
    assert set(rows) == {"c0", "c1", "c2", "c3"}, text
    # A seed against the defaults, a child against its parent; modeled time and speedup.
    assert "3.16 us" in rows["c0"] and "1.90x" in rows["c0"] and "defaults" in rows["c0"]
    assert "block_size=256" in rows["c1"] and "num_warps=8" in text
    assert "c0" in rows["c2"] and "block_size 1024->512" in rows["c2"]
    assert "mismatch" in rows["c3"] and "block_size 256->2048" in rows["c3"]
    assert "ids after job-6b64edecba2147378768aa53cbd9cc32-" in text
    assert "a model of a GPU, not a measurement" in text
    # The best list, best first, with short ids that are never wrapped, and a speedup.
    best = text.split("best candidates")[1].splitlines()
    ranked = [line.split()[:2] for line in best if line.strip()[:1].isdigit()]
    assert ranked == [["1", "c0"], ["2", "c2"], ["3", "c1"]], text
    assert "n/a" not in text and "1.80x" in text


def test_progress_counts_evolve_rounds_from_1() -> None:
    from services.cli.render import progress_line

    record = evolve_record("modeled_time")
    record.progress.max_rounds, record.progress.round = 3, 1
    assert "round 1/3" in progress_line(record)
    record.progress.round = 0  # before the generator's first report
    assert "round 1/3" in progress_line(record)


def test_workers_shows_the_device_list_as_a_list() -> None:
    from services.cli.render import workers_table

    text = render(workers_table({"workers": [
        {"worker_id": "w1", "backend": "cpu", "arch": "x86_64", "devices": ["0"],
         "capacity": 1, "in_flight": 0},
        {"worker_id": "w2", "backend": "cuda", "arch": "h100", "devices": ["0", "1"],
         "capacity": 2, "in_flight": 1}]}))
    assert "[0]" in text and "[0, 1]" in text


BATCH = (["good.py", "same.py", "a_kernel_with_a_rather_long_file_name_indeed.py", "wrong.py"],
         [{"passed": True, "duration_s": 3.2},
          {"passed": True, "duplicate_of": 0, "duration_s": 3.2},
          {"passed": False, "stage": "infrastructure", "error": "the worker died " * 30,
           "duration_s": 1.0},
          {"passed": False, "stage": "mismatch", "duration_s": 2.0,
           "error": "output 0: 12 of 2048 elements differ beyond atol=1e-4 rtol=1e-4"}])


def printed(monkeypatch, report_args) -> str:
    """What batch.report prints on an 80-column stdout."""
    import io

    from services.cli import batch

    console = Console(width=80, file=io.StringIO(), record=True)
    monkeypatch.setattr(batch, "out", console)
    batch.report(*report_args, as_json=False)
    return console.export_text()


def test_the_batch_table_fits_80_columns_with_errors_below(monkeypatch) -> None:
    text = printed(monkeypatch, BATCH)
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines), text
    header = next(line for line in lines if "kernel" in line)
    assert "passed" in header and "stage" in header and "same as" in header, text
    wrong = next(line for line in lines if "wrong.py" in line and "│" in line)
    assert "no" in wrong and "mismatch" in wrong
    assert "infrastructure" in text
    # Errors below the table, each named by its row; the long one cut with an ellipsis.
    below = text.split("errors:")[1]
    assert "#3 wrong.py: output 0: 12 of 2048 elements differ" in below
    assert "#2 a_kernel_with_a_rather_long_file_name_indeed.py: the worker died" in below
    assert "…" in below and "2 of 4 kernels passed" in below


def test_one_kernel_through_the_gateway_prints_the_normal_verdict(monkeypatch) -> None:
    verdict = {"index": 0, "candidate_id": "b-c0", "request_id": "b-a0", "passed": False,
               "stage": "mismatch", "error": "output 0: 3 of 64 elements differ",
               "max_abs_error": 0.5, "trials": 1, "interpreted": True, "duration_s": 2.5,
               "worker_id": "w-cpu", "finished_at": "2026-11-30T08:00:00+00:00"}
    text = printed(monkeypatch, (["k.py"], [verdict]))
    assert "verdict: k.py" in text and "verdicts" not in text, text
    assert "stage" in text and "mismatch" in text and "3 of 64 elements differ" in text
    assert "w-cpu" in text and "device" not in text and "interpreter" in text


def test_a_pass_that_is_not_shape_generic_says_so_beside_passed() -> None:
    verdict = VerifyResult(request_id="r", job_id="j", candidate_id="c", passed=True,
                           worker_id="w", device="0", duration_s=0.5, max_abs_error=0.0,
                           shape_generic=False, shape_generic_sizes={"dim": 2593})
    text = render(verdict_table(verdict))
    assert "yes, at the sizes checked; wrong at other sizes (shape generic: no)" in text, text
    generic = render(verdict_table(msgspec.structs.replace(verdict, shape_generic=True)))
    assert "wrong at other sizes" not in generic
