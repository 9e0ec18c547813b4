"""bench/fleet_faults.py: its options, its reading of the worker's log, and one small
fault on a real stack (a SIGKILLed worker under `aikg up` loses no job)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import fleet_faults


def test_bad_options_are_refused() -> None:
    for argv in (["--jobs", "1"], ["--clients", "0"], ["--faults", "disk"]):
        with pytest.raises(SystemExit) as exc:
            fleet_faults.main(argv)
        assert exc.value.code == 2, argv


def test_verified_twice_counts_requests_finished_more_than_once(tmp_path: Path) -> None:
    def line(request_id: str, event: str = "verify_finished") -> str:
        return json.dumps({"event": event, "request_id": request_id, "passed": True})

    (tmp_path / "worker.log").write_text("\n".join([
        line("a"), line("b"), line("a"), line("c", "verify_started"), line("c"),
        "not json", line("a")]) + "\n")
    assert fleet_faults.verified_twice(tmp_path) == {"a": 3}
    assert fleet_faults.verified_twice(tmp_path / "missing") == {}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_small_worker_fault_loses_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert fleet_faults.main(["--faults", "worker", "--jobs", "4", "--clients", "2"]) == 0
    out = capsys.readouterr().out
    (row,) = [ln.split() for ln in out.splitlines() if ln.startswith("worker ")]
    fault, accepted, completed, failed, lost, _dup, restarts, _recovery, _wall = row
    assert (accepted, completed, failed, lost, restarts) == ("4", "4", "0", "0", "1"), out
