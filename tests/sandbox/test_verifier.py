"""The verifier end to end on the cpu backend (Triton interpreter), plus its comparison rules.

One Verifier (one fork server) serves the whole module, as it would in a worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import os
import signal
import time

import pytest
import torch

from schemas.events import VerifyRequest
from services.common.verify_client import build_request
from services.sandbox import channel
from services.sandbox.channel import captured_output, describe_exit
from services.sandbox.server import clean_environment
from services.sandbox.wire import ChildSpec
from services.worker import correctness, wire
from services.worker import timing as worker_timing
from services.worker.inputs import LARGE, SMALL
from services.worker.procedure import Outcome, Timings
from services.worker.procedure import Verdict as _Verdict
from services.worker.procedure.profile import check_timing, speedup_fields
from services.worker.verifier import Verifier
from tests.helpers import RELU_TASK
from tests.support_candidates import TRITON_IMPORTS, relu_jit, relu_model

KERNEL = TRITON_IMPORTS + "\n\n" + relu_jit("tl.maximum(x, floor)", params=", floor")


def relu_candidate(floor: float = 0.0) -> str:
    return KERNEL + "\n\n" + relu_model(args=f", {floor}")


COMPILE_ERROR_CANDIDATE = TRITON_IMPORTS + "\n\n" + relu_jit("tl.no_such_function(x)") + """

class ModelNew(nn.Module):
    def forward(self, x):
        out = torch.empty_like(x)
        n = x.numel()
        relu_kernel[(triton.cdiv(n, 1024),)](x, out, n, BLOCK_SIZE=1024)
        return out
"""


def request(code: str | None = None, task: str = RELU_TASK, **kwargs) -> VerifyRequest:
    fields = {"request_id": f"req-{time.monotonic_ns()}", "job_id": "job-test",
              "candidate_id": "cand-test", "op_name": "relu", "task_desc": task,
              "code": code if code is not None else relu_candidate(), "backend": "cpu",
              "arch": "x86_64", "timeout_s": 30.0}
    fields.update(kwargs)
    return build_request(**fields)


@pytest.fixture
def verifier(shared_verifier):
    """The session's started cpu verifier (64 MiB input limit, tests/conftest.py)."""
    return shared_verifier


# ------------------------------------------------------------------ end to end


async def test_correct_relu_passes(verifier):
    result = await verifier.verify(request(), device="0")
    assert result.passed, result
    assert result.stage is None and result.error is None
    assert result.interpreted is True
    assert result.speedup is None and result.base_time_us is None and result.gen_time_us is None
    assert (result.atol, result.rtol) == (1e-4, 1e-4)
    assert result.trials == 3
    assert result.max_abs_error == 0.0
    assert result.worker_id == "test-shared" and result.device == "0"


async def test_wrong_candidate_is_a_mismatch_with_details(verifier):
    result = await verifier.verify(request(relu_candidate(floor=0.1)), device="0")
    assert not result.passed
    assert result.stage == "mismatch"
    assert "elements differ beyond atol=1e-4 rtol=1e-4" in result.error
    assert result.error.startswith("output 0: ")
    assert "(expected " in result.error and "got 0.1" in result.error
    assert "in trial 0" in result.error and "seed" not in result.error
    assert result.max_abs_error == pytest.approx(0.1, abs=1e-6)
    assert 0 < result.mismatch_count < 16 * 1024
    assert 1 <= len(result.mismatch_indices) <= 5
    assert all(len(ix) == 2 for ix in result.mismatch_indices)
    assert (result.atol, result.rtol) == (1e-4, 1e-4)


async def test_compile_error_in_kernel(verifier):
    result = await verifier.verify(request(COMPILE_ERROR_CANDIDATE), device="0")
    assert not result.passed
    # The interpreter surfaces it as AttributeError inside the kernel; reported as the
    # compile error a GPU would raise.
    assert result.stage == "compile"
    assert result.error.startswith("compiling the Triton kernel relu_kernel raised AttributeError")
    assert "no_such_function" in result.error
    assert "candidate.py line 13" in result.error
    assert "Traceback" in result.log


async def test_syntax_error_is_compile_with_line(verifier):
    result = await verifier.verify(request(relu_candidate() + "\ndef oops(:\n"), device="0")
    assert result.stage == "compile"
    assert result.error.startswith("line ")
    assert "SyntaxError" in result.error


async def test_static_rejection_spawns_nothing(verifier):
    before = verifier.candidate_runs
    code = relu_candidate().replace("return out", "return torch.relu(x)")
    result = await verifier.verify(request(code), device="0")
    assert result.stage == "static"
    assert "torch.relu called in ModelNew.forward" in result.error
    assert verifier.candidate_runs == before


BIG_TASK = RELU_TASK.replace("batch_size = 16", "batch_size = 4096").replace(
    "dim = 1024", "dim = 65536")


async def test_inputs_over_the_memory_limit_fail_fast(verifier):
    started = time.monotonic()
    result = await verifier.verify(request(task=BIG_TASK), device="0")
    # The user's to fix with smaller sizes, not the worker's fault.
    assert result.stage == "task"
    assert result.error.startswith("task inputs need 1.0 GiB (limit 64.0 MiB): the task "
                                   "is too big for this worker")
    assert 'shape_overrides such as {"batch_size": ' in result.error
    assert result.error.endswith("the task's largest sizes: dim=65536, batch_size=4096")
    # Measured on fake tensors: nothing of 1 GiB was allocated or sent.
    assert time.monotonic() - started < 5


async def test_shape_overrides_shrink_the_task(verifier):
    result = await verifier.verify(
        request(task=BIG_TASK, shape_overrides={"batch_size": 4, "dim": 2048}), device="0")
    assert result.passed, result


async def test_unknown_shape_override_is_infrastructure(verifier):
    result = await verifier.verify(request(shape_overrides={"batch": 4}), device="0")
    assert result.stage == "infrastructure"
    assert "shape_overrides name 'batch', which the task does not assign" in result.error


async def test_broken_reference_is_infrastructure(verifier):
    task = RELU_TASK.replace("return torch.relu(x)", "raise RuntimeError('reference broke')")
    result = await verifier.verify(request(task=task), device="0")
    assert result.stage == "infrastructure"
    assert "reference run" in result.error and "reference broke" in result.error


async def test_every_verification_draws_its_own_inputs(verifier):
    """Seeds are secret and fresh per verification: one reference child each, whose
    outputs no other verification can reuse; the trials' distributions are named."""
    runs = verifier.reference_runs
    first = await verifier.verify(request(), device="0")
    second = await verifier.verify(request(), device="1")
    assert first.passed and second.passed, (first, second)
    assert verifier.reference_runs == runs + 2
    assert first.reference_source == second.reference_source == "run"
    # Trial 0 the task's own; the others mix the large and the small magnitudes (which
    # comes first is drawn), so three trials reach every distribution.
    note = next(n for n in first.notes if n.startswith("inputs: "))
    large, small = "mix: " + ", ".join(LARGE), "mix: " + ", ".join(SMALL)
    assert note in (f"inputs: trial 0: task; trial 1: {large}; trial 2: {small}",
                    f"inputs: trial 0: task; trial 1: {small}; trial 2: {large}"), note
    more = await verifier.verify(request(trials=5), device="0")
    assert more.passed and more.trials == 5
    note = next(n for n in more.notes if n.startswith("inputs: "))
    assert note.count(large) == 2 and note.count(small) == 2, note


async def test_concurrent_verifies_do_not_block_the_loop(verifier):
    ticks = 0
    stop = asyncio.Event()

    async def ticker():
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0.01)

    tick_task = asyncio.create_task(ticker())
    started = time.monotonic()
    results = await asyncio.gather(
        verifier.verify(request(), device="0"),
        verifier.verify(request(relu_candidate(floor=0.1)), device="1"),
        verifier.verify(request(), device="2"),
    )
    elapsed = time.monotonic() - started
    stop.set()
    await tick_task
    assert [r.passed for r in results] == [True, False, True]
    assert results[1].stage == "mismatch"
    # The loop kept running while the children worked (a tick every ~10 ms).
    assert ticks >= elapsed / 0.01 * 0.2


async def test_the_static_check_runs_off_the_event_loop(verifier, monkeypatch):
    """A long candidate's static check (seconds for a lowered network) must not stall
    the loop that runs the worker's heartbeats: it runs in a worker thread."""
    import threading

    from services.worker import verifier as verifier_module

    threads = []
    check = verifier_module.check_candidate

    def recording(code, dsl="triton"):
        threads.append(threading.get_ident())
        return check(code, dsl)

    monkeypatch.setattr(verifier_module, "check_candidate", recording)
    result = await verifier.verify(request(), device="0")
    assert result.passed, result
    assert threads and threading.get_ident() not in threads


async def test_a_candidate_too_deep_to_check_is_static_not_infrastructure(verifier):
    """A hostile candidate nests one expression past the recursion limit: the verdict
    is the candidate's (stage static, S024), and nothing is spawned for it."""
    code = (relu_candidate() + "\n\ndef chain(x):\n    return "
            + "+".join(["x"] * 5000) + "\n")
    result = await verifier.verify(request(code), device="0")
    assert not result.passed and result.stage == "static", (result.stage, result.error)
    assert "S024" in result.log or "too deeply" in result.error, result.error


async def test_profile_mode_on_cpu_has_no_timings(verifier):
    result = await verifier.verify(request(mode="profile"), device="0")
    assert result.passed
    assert result.interpreted and result.speedup is None and result.gen_time_us is None
    assert "no timings on the cpu backend" in result.log


async def test_wrong_backend_is_infrastructure(verifier):
    result = await verifier.verify(request(backend="cuda", arch="h200"), device="0")
    assert result.stage == "infrastructure"
    assert "verifies on cpu" in result.error


@pytest.fixture(scope="module")
def own_verifier(tmp_path_factory):
    """A verifier of this module's own: its scratch root sees no other module's runs."""
    v = Verifier("cpu", worker_id="test-scratch",
                 scratch_root=tmp_path_factory.mktemp("own") / "verifier")
    v.start()
    yield v
    v.close()


@pytest.mark.slow  # starts a verifier of its own
async def test_scratch_directories_are_removed(own_verifier):
    verifier = own_verifier
    await verifier.verify(request(), device="0")
    assert list((verifier.scratch_root / "runs").iterdir()) == []
    assert (verifier.scratch_root / "triton-cache" / "0").is_dir()


async def test_a_candidate_failing_beside_its_side_children_leaves_no_scratch(own_verifier):
    """A failed candidate cancels the ghost replay and second size running beside it
    (cpu): their children are killed and their scratch directories removed too."""
    verifier = own_verifier
    for _ in range(4):
        result = await verifier.verify(request(relu_candidate(floor=0.5), trials=1),
                                       device="0")
        assert result.stage == "mismatch", result
    assert list((verifier.scratch_root / "runs").iterdir()) == []


async def test_verifications_cancelled_as_their_children_start_leave_nothing(own_verifier,
                                                                            caplog):
    """A verification cancelled at any point while its children are forked and starting
    (a job cancelled, a worker stopping): every child is reaped, its scratch directory
    removed, and no start is left pending on a closed socket."""
    verifier = own_verifier
    for delay in (0.0, 0.02, 0.06, 0.12, 0.25):
        running = asyncio.ensure_future(verifier.verify(request(), device="0"))
        await asyncio.sleep(delay)
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
    assert await channel.settle()
    gc.collect()
    await asyncio.sleep(0)
    assert "Task was destroyed but it is pending" not in caplog.text
    assert list((verifier.scratch_root / "runs").iterdir()) == []


async def test_latency_of_a_warm_verify(verifier):
    """~0.3 s per forked child for a tiny interpreted relu vs ~2.9 s for a cold one.

    A verify runs three candidate children (the trials, the ghost replay and the
    second size; the last two side by side): cold children would take ~9 s.
    """
    await verifier.verify(request(trials=1), device="0")  # reference cached
    timings = []
    for _ in range(3):
        started = time.monotonic()
        result = await verifier.verify(request(trials=1), device="0")
        timings.append(time.monotonic() - started)
        assert result.passed
    print(f"warm verify latency (1 trial, cached reference): "
          f"{', '.join(f'{t:.3f}' for t in timings)} s")
    assert min(timings) < 2.5


def test_sandbox_probe_results(verifier):
    # Root here: children switch to nobody and lose the network.
    assert verifier.network_isolated is not None
    if verifier.run_as is not None:
        assert verifier.run_as[0] != 0


def test_timings_larger_than_wall_time_are_inconsistent(verifier):
    timing = wire.Timing(median_us=1000.0, samples_us=[1000.0] * 20, wall_s=0.0)
    with pytest.raises(_Verdict) as info:
        check_timing(timing, time.monotonic(), "the candidate")
    assert info.value.outcome.fields.stage == "infrastructure"
    assert info.value.outcome.fields.error.startswith("timings inconsistent")
    # 20 ms of samples after 1 s of wall time is consistent.
    check_timing(timing, time.monotonic() - 1.0, "the candidate")


# ------------------------------------------------------------------ correctness rules


def test_tolerance_table():
    tol = correctness.tolerance_for
    assert (tol(torch.float32).atol, tol(torch.float32).rtol) == (1e-4, 1e-4)
    assert tol(torch.float32, "cuda").atol == 5e-3
    assert tol(torch.float16).atol == 1e-2
    assert tol(torch.bfloat16).rtol == 2e-2
    assert tol(torch.float64).atol == 1e-7
    assert tol(torch.int32).atol == 0 and tol(torch.bool).rtol == 0
    assert tol(torch.complex64) == tol(torch.float32)
    assert correctness.format_tolerance(1e-4) == "1e-4"
    assert correctness.format_tolerance(1.25e-1) == "1.25e-1"


def test_mismatch_message_and_indices():
    expected = torch.zeros(4, 8)
    got = expected.clone()
    got[1, 2] = 0.5
    got[3, 7] = 0.25
    cmp = correctness.compare_output(0, expected, got)
    assert not cmp.passed
    assert cmp.mismatch_count == 2
    assert cmp.mismatch_indices == [[1, 2], [3, 7]]
    assert cmp.message == ("output 0: 2 of 32 elements differ beyond atol=1e-4 rtol=1e-4; "
                           "max abs error 0.5 at [1, 2] (expected 0, got 0.5)")
    assert cmp.max_abs_error == 0.5


def test_within_tolerance_passes():
    expected = torch.randn(64, 64)
    got = expected * (1 + 5e-5)
    assert correctness.compare_outputs([expected], [got]).passed


def test_shape_and_dtype_message():
    cmp = correctness.compare_output(0, torch.zeros(16, 4096, dtype=torch.float64),
                                     torch.zeros(16, 4096))
    assert cmp.message == ("output 0 has shape (16, 4096) and dtype float32; expected "
                           "(16, 4096) and float64")


def test_nan_and_inf_positions_must_match():
    expected = torch.tensor([1.0, math.nan, math.inf, 2.0])
    assert correctness.compare_output(0, expected, expected.clone()).passed
    got = torch.tensor([1.0, 0.0, math.inf, math.nan])
    cmp = correctness.compare_output(0, expected, got)
    assert cmp.mismatch_count == 2 and cmp.mismatch_indices == [[1], [3]]
    assert "NaN/Inf positions differ" in cmp.message
    got = torch.tensor([1.0, math.nan, -math.inf, 2.0])
    assert not correctness.compare_output(0, expected, got).passed


def test_integers_compare_exactly():
    expected = torch.arange(10)
    got = expected.clone()
    got[4] += 1
    cmp = correctness.compare_output(0, expected, got)
    assert cmp.mismatch_count == 1 and "differ exactly" in cmp.message


@pytest.mark.parametrize("name", ["random", "with zeros", "all zeros", "inf and -0.0",
                                  "only inf", "float16", "bfloat16", "float64", "huge float64",
                                  "int64", "bool", "bool all false", "one element"])
def test_equal_outputs_shortcut_gives_the_full_comparisons_result(name):
    torch.manual_seed(0)
    expected = {
        "random": torch.randn(64, 33),
        "with zeros": torch.relu(torch.randn(16, 16)),
        "all zeros": torch.zeros(8, 8),
        "inf and -0.0": torch.tensor([math.inf, -math.inf, -0.0, 0.0, 1.5]),
        "only inf": torch.tensor([math.inf, -math.inf]),
        "float16": torch.randn(40).half(),
        "bfloat16": torch.randn(40).bfloat16(),
        "float64": torch.randn(7, 5, dtype=torch.float64),
        "huge float64": torch.full((4,), 1e200, dtype=torch.float64),
        "int64": torch.arange(-5, 5),
        "bool": torch.tensor([True, False, True]),
        "bool all false": torch.zeros(3, dtype=torch.bool),
        "one element": torch.tensor([3.0]),
    }[name]
    got = expected.clone()
    # -0.0 where +0.0 is expected: equal values, different bits.
    got[got == 0] = -0.0 if got.dtype.is_floating_point else 0
    short = correctness.compare_output(0, expected, got)
    full = correctness.compare_output(0, expected, got, shortcut=False)
    assert short == full and short.passed


def test_nan_outputs_take_the_full_comparison():
    expected = torch.tensor([1.0, math.nan])
    short = correctness.compare_output(0, expected, expected.clone())
    assert short == correctness.compare_output(0, expected, expected.clone(), shortcut=False)
    assert short.passed and short.max_abs_error == 0.0


def test_a_mismatch_without_detail_is_the_same_verdict():
    expected = torch.randn(32, 32)
    half_nan = expected.clone()
    half_nan[:16] = math.nan
    for got in (torch.full_like(expected, math.nan), half_nan, expected + 1, expected * (1 + 5e-5),
                torch.full_like(expected, float(expected.mean()))):
        full = correctness.compare_outputs([expected], [got])
        quick = correctness.compare_outputs([expected], [got], detail=False)
        assert quick.passed == full.passed
        if not full.passed:
            assert 0 < quick.outputs[0].mismatch_count <= full.outputs[0].mismatch_count
    # Within atol everywhere but off in scale: counted no mismatch, still fails.
    tiny = expected * 1e-6
    assert not correctness.compare_outputs([tiny], [torch.zeros_like(tiny)], detail=False).passed
    quick = correctness.compare_output(0, expected, torch.full_like(expected, math.nan),
                                       detail=False)
    assert quick.message == "output 0: 1024 of 1024 elements differ"
    assert quick.max_abs_error is None and quick.mismatch_indices == []


def test_output_count_mismatch():
    cmp = correctness.compare_outputs([torch.zeros(2)], [torch.zeros(2), torch.zeros(2)])
    assert cmp.message == "ModelNew.forward returned 2 outputs; expected 1"


# ------------------------------------------------------------------ sandbox helpers


def test_environment_is_an_allowlist():
    env = {"PATH": "/bin", "AIKG_LLM_API_KEY": "x", "OPENAI_API_KEY": "x", "GITHUB_TOKEN": "x",
           "DB_PASSWORD": "x", "AWS_SECRET_ACCESS_KEY": "x", "MY_CREDENTIALS": "x",
           "AIKG_NATS_URL": "x", "NATS_URL": "x", "AIKG_WORKER_BACKEND": "cpu",
           "DATABASE_URL": "postgres://u:p@db/x", "HOME": "/root", "SSH_AUTH_SOCK": "/s",
           "OPENBLAS_CORETYPE": "Haswell", "CUDA_VISIBLE_DEVICES": "0", "LC_ALL": "C",
           "TRITON_CACHE_DIR": "/c", "TRITON_API_TOKEN": "x"}
    assert clean_environment(env) == {"PATH": "/bin", "OPENBLAS_CORETYPE": "Haswell",
                                      "CUDA_VISIBLE_DEVICES": "0", "LC_ALL": "C",
                                      "TRITON_CACHE_DIR": "/c"}
    assert clean_environment(env, ("DATABASE_*",)) == {
        **clean_environment(env), "DATABASE_URL": "postgres://u:p@db/x"}


def test_describe_exit():
    assert describe_exit(signal.SIGSEGV).startswith("killed by signal SIGSEGV (segmentation")
    assert describe_exit(3 << 8) == "exited with code 3"
    assert os.WIFEXITED(3 << 8)


def test_captured_output_is_capped(tmp_path):
    (tmp_path / "stdout.txt").write_text("a" * 10_000 + "END")
    (tmp_path / "stderr.txt").write_text("boom")
    text = captured_output(tmp_path, 1000)
    assert len(text.encode()) <= 1100
    assert text.rstrip().endswith("boom") and "END" in text and "cut" in text


def test_speedup_flagging():
    timings = speedup_fields(1000.0, 100.0, bound=50.0)
    assert timings == Timings(base_time_us=1000.0, gen_time_us=100.0, speedup=10.0, flag=None,
                              speedup_eager=10.0)
    flagged = speedup_fields(1000.0, 10.0, bound=50.0)
    assert flagged.speedup == 100.0
    assert flagged.flag.startswith("flagged: speedup 100.0 exceeds the bound 50")
    # The flag becomes the passed outcome's error; the pass stands.
    outcome = Outcome(passed=True, trials=3).timed(flagged)
    assert outcome.fields.passed and outcome.fields.error == flagged.flag
    assert outcome.fields.gen_time_us == 10.0
    assert speedup_fields(1000.0, 0.0, bound=50.0).speedup == float("inf")


def test_time_forward_warms_up_flushes_and_takes_the_median(monkeypatch):
    """The GPU timing loop, run against a stand-in for torch.cuda on the CPU."""
    calls = []

    class FakeEvent:
        def __init__(self, enable_timing: bool) -> None:
            assert enable_timing
            self.at = 0.0

        def record(self) -> None:
            self.at = time.perf_counter()

        def synchronize(self) -> None:
            calls.append("event.synchronize")

        def elapsed_time(self, end: FakeEvent) -> float:
            return (end.at - self.at) * 1000.0  # milliseconds, like torch.cuda.Event

    class FakeAccelerator:
        Event = FakeEvent

        @staticmethod
        def synchronize() -> None:
            calls.append("synchronize")

    def model(x):
        calls.append("forward")
        time.sleep(0.001)
        return x

    monkeypatch.setattr(worker_timing, "accelerator", lambda backend: FakeAccelerator)
    spec = ChildSpec(role="candidate", scratch_dir="/tmp",
                     params={"warmup": 2, "repeats": 5, "flush_bytes": 1024})
    timing = worker_timing.time_forward(model, [torch.zeros(4)], spec)
    assert calls[:3] == ["forward", "forward", "synchronize"]
    assert calls.count("forward") == 7 and calls.count("event.synchronize") == 5
    assert len(timing.samples_us) == 5
    assert all(900 < s < 100_000 for s in timing.samples_us)
    assert timing.median_us == sorted(timing.samples_us)[2]
    assert timing.wall_s * 1e6 >= sum(timing.samples_us)


@pytest.mark.slow
async def test_pool_recovers_after_the_fork_server_dies(verifier):
    """Last in this module: it costs a fork-server restart (~2 s)."""
    proc = verifier.sandbox.pool._proc
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    restarts = verifier.sandbox.pool.restarts
    result = await verifier.verify(request(), device="0")
    assert result.passed, result
    assert verifier.sandbox.pool.restarts == restarts + 1
