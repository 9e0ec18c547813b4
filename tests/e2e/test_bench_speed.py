"""``python -m bench.speed`` runs end to end with tiny counts and prints its four figures.

A benchmark never gates on its numbers, but one that crashes measures nothing; this
runs the real thing (an embedded nats-server, an ``aikg worker`` process, cold python
processes, an ``aikg up`` stack) with the smallest counts and checks the lines a reader
compares.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import scaled

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_bench_speed_prints_every_figure_with_its_phases(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIKG_")}
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "bench.speed", "--burst", "2", "--cold", "1", "--seq", "1",
         "--jobs", "2", "--checks", "1", "--rows", "4"],
        cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp)},
        capture_output=True, text=True, timeout=scaled(540))
    out = proc.stdout
    assert proc.returncode == 0, (out + proc.stderr)[-4000:]
    # Its workdir, the stack's logs and run directory, the sandboxes' scratch: all gone
    # (torch's own cache directory, torchinductor_<user>, is torch's to keep).
    assert sorted(p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_")) == []
    assert re.search(r"^\(a\) burst of 2 one-trial verifications through the bus: [\d.]+ s each "
                     r"\(\d+/min\); cold python per candidate: [\d.]+ s each; ratio [\d.]+x$",
                     out, re.M), out
    # The candidate and its own run, the floor under a trial's time.
    assert re.search(r"^candidate: built-in coder, block_size 4096; its own forward at 4 x 4096, "
                     r"interpreted in one warm process: [\d.]+ s", out, re.M), out
    assert re.search(r"^\(b\) RemoteWorker +three trials, sequential: p50 [\d.]+ s", out, re.M)
    assert re.search(r"^\(b\) LocalWorker +three trials, sequential: p50 [\d.]+ s", out, re.M)
    assert re.search(r"^\(b\) bus overhead \(RemoteWorker p50 - LocalWorker p50\): [+-]\d+ ms$",
                     out, re.M), out
    assert re.search(r"^\(c\) small job .*: p50 [\d.]+ s, p95 [\d.]+ s over 2$", out, re.M), out
    # Each figure against its target, said met or missed.
    for figure in (r"\(a\) ratio to one cold python per candidate: [\d.]+x \(target >= 10x\)",
                   r"\(b\) RemoteWorker three-trial p50: [\d.]+ s \(target <= 0\.6 s\)",
                   r"\(b\) bus overhead: [+-]\d+ ms \(target <= 20 ms\)",
                   r"\(c\) small job p50: [\d.]+ s \(target <= 1\.5 s\)",
                   r"\(d\) three-trial verification / the candidate's own three calls: "
                   r"[\d.]+x \(target <= 1\.5x\)"):
        assert re.search(r"^  " + figure + r": (met|missed)$", out, re.M), (figure, out)
    assert re.search(r"^\(d\) every check +three-trial verification in this process: p50 "
                     r"[\d.]+ s", out, re.M), out
    assert re.search(r"^\(d\) the candidate's own three calls: [\d.]+ s; every check costs "
                     r"[\d.]+x that, the compile check \(cached\) [+-]\d+ ms$", out, re.M), out
    # Each figure carries its phase breakdown (the verify request's, then the job's).
    assert re.search(r"worker phases \(median s\): .*candidate_start [\d.]+", out), out
    assert re.search(r"job phases \(median s\): .*verify_wait [\d.]+", out), out
