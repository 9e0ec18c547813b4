"""bench/gpu_check.py, the prepared CUDA check, kept runnable on a machine without a GPU.

GPU time is scarce, so the script's plumbing is exercised here: without CUDA it exits
2 and says why; its evolve part runs end to end against a cpu stack (where timings
mean nothing, so only the speedup expectation fails); its out-of-bounds rewrite
applies to the built-in coder's current output.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import torch

from bench import gpu_check
from services.generator.lowering import lower_task
from tests.helpers import ROOT, scaled

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")


@needs_no_cuda
def test_exits_2_and_says_why_without_cuda() -> None:
    run = subprocess.run([sys.executable, "-m", "bench.gpu_check"], cwd=ROOT,
                         capture_output=True, text=True, timeout=scaled(120))
    assert run.returncode == 2, run.stdout + run.stderr
    assert "gpu_check: cannot run here:" in run.stderr
    assert "CUDA" in run.stderr or "GPU" in run.stderr


def test_out_of_bounds_rewrites_the_builtin_coders_store() -> None:
    code = lower_task(gpu_check.TASK_PATH.read_text(), {"batch_size": 4, "dim": 8})
    faulty = gpu_check.out_of_bounds(code)
    assert f"out_ptr + offsets + {gpu_check.OOB_OFFSET}" in faulty
    assert "tl.store(out_ptr + offsets, " not in faulty
    with pytest.raises(ValueError, match="update bench/gpu_check.py"):
        gpu_check.out_of_bounds("no store here")


@pytest.mark.slow
def test_evolve_part_runs_end_to_end_on_a_cpu_stack(tmp_path, capsys) -> None:
    args = argparse.Namespace(batch=8, dim=256, rounds=2, parallel=2, islands=2, device="0",
                              arch=None, evolve_timeout=240.0, log_dir=str(tmp_path / "logs"),
                              record_out=str(tmp_path / "record.json"))
    checks = gpu_check.evolve_checks(args, backend="cpu")
    by_name = {name: (held, got) for name, _, held, got in checks}
    assert by_name["evolve job completes"][0], by_name
    # cpu: no speedup is measured (candidates rank by the modeled time of their counted
    # traffic), so the GPU expectation does not hold.
    assert by_name["best evolve candidate beats eager PyTorch"] == (False, "speedup=None")
    printed = capsys.readouterr().out
    assert "fitness modeled_time, 4 candidates" in printed
    assert "verify_result" in printed
    assert (tmp_path / "record.json").read_text().count('"candidate_id"') >= 4
    assert (tmp_path / "logs" / "worker.log").exists()


async def test_corpus_part_runs_on_the_cpu_backend(capsys) -> None:
    args = argparse.Namespace(device="0", arch=None, timeout=scaled(120.0))
    checks = await gpu_check.corpus_checks(
        args, backend="cpu", only=["relu_wrong_above_six", "elementwise_relu"])
    assert [(name, held, got) for name, _, held, got in checks] == [
        ("hostile corpus candidates fail", True, "1 of 1"),
        ("honest corpus candidates pass", True, "1 of 1")]
    printed = capsys.readouterr().out
    assert "[ok] hostile relu_wrong_above_six: passed=False stage=mismatch (cpu: mismatch)" \
        in printed
    assert "[ok] honest elementwise_relu: passed=True" in printed
