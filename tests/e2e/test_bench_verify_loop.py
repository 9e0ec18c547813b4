"""``python -m bench.verify_loop`` runs end to end with the smallest counts and prints
every figure a reader compares (a benchmark never gates on its numbers, but one that
crashes measures nothing)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import scaled

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_bench_verify_loop_prints_every_figure() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIKG_")}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.verify_loop", "--saves", "1", "--trials", "1",
         "--no-run"],
        cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=scaled(540))
    out = proc.stdout
    assert proc.returncode == 0, (out + proc.stderr)[-4000:]
    for figure in ("(a) first aikg verify", "(a) second aikg verify",
                   "(b) aikg verify --watch, first verdict", "(b) --watch, save to verdict",
                   "(b) second aikg verify / --watch re-verify",
                   "(c) static refusal before", "(c) static refusal now", "(c) before / now"):
        assert figure in out, out
    assert "left in the scratch directory" not in out, out
