"""Benchmarks (not timed tests): ``python -m bench.verify_throughput``, ``python -m bench.gpu_check``."""

from __future__ import annotations

import subprocess


def stop_process(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM ``proc`` and wait for it; SIGKILL it if it has not ended in ``timeout_s``."""
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
