"""Benchmarks (not timed tests): ``python -m bench.verify_throughput``, ``python -m bench.gpu_check``."""

from __future__ import annotations

import argparse
import subprocess
from collections.abc import Iterable


def stop_process(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM ``proc`` and wait for it; SIGKILL it if it has not ended in ``timeout_s``."""
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def add_number_options(parser: argparse.ArgumentParser,
                       options: Iterable[tuple[str, type[int] | type[float], float, str]]
                       ) -> None:
    """Add one ``--flag`` option per ``(flag, type, default, help)`` row to ``parser``,
    each help ending in ``(default <default>)`` (the default written with ``:g``)."""
    for flag, kind, default, text in options:
        parser.add_argument(flag, type=kind, default=default,
                            help=f"{text} (default {default:g})")
