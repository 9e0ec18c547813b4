"""Where ``aikg run`` puts the kernel: ``-o FILE`` writes its exact source, a pipe gets
the plain source alone (``aikg run task.py > kernel.py``), ``--json`` the whole result.
The local run itself is replaced by a canned result (its verification is the sandbox
tests' business), so these run in milliseconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from services.cli import app, local

ROOT = Path(__file__).resolve().parents[2]
TASK = str(ROOT / "tasks" / "relu.py")
# No trailing newline: what the kernel becomes in a file or a pipe ends with one.
KERNEL = "import triton\n\n@triton.jit\ndef relu_kernel(x_ptr):\n    pass"
VERDICT = {"request_id": "r", "job_id": "j", "candidate_id": "c", "worker_id": "local",
           "device": "0", "passed": True, "max_abs_error": 0.0, "atol": 1e-4, "rtol": 1e-4,
           "trials": 3, "interpreted": True, "duration_s": 1.5}


@pytest.fixture
def canned(monkeypatch: pytest.MonkeyPatch):
    """``canned(passed)``: ``aikg run`` answers with this kernel and verdict."""

    def use(passed: bool = True) -> None:
        async def run_local(*args, **kwargs):
            return "relu", passed, {"backend": "cpu", "arch": "x86_64", "attempts": 1,
                                    "coder": "builtin", "code": KERNEL,
                                    "verdict": {**VERDICT, "passed": passed}}

        monkeypatch.setattr(local, "_run_local", run_local)

    return use


def invoke(*args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "100"})


def test_run_o_writes_the_kernel_exactly_and_says_where(canned, tmp_path: Path) -> None:
    canned()
    path = tmp_path / "kernel.py"
    result = invoke("run", TASK, "-o", str(path))
    assert result.exit_code == 0, result.output
    assert path.read_bytes() == (KERNEL + "\n").encode()
    assert f"kernel written to {path} (5 lines)" in result.stderr
    # The verdict still shows, without the kernel's panel.
    assert "passed" in result.stdout and "relu_kernel" not in result.stdout


def test_run_piped_prints_the_plain_kernel_alone_on_stdout(canned) -> None:
    canned()
    result = invoke("run", TASK)
    assert result.exit_code == 0, result.output
    assert result.stdout == KERNEL + "\n"  # no box, no line numbers, no wrapping
    assert "passed" in result.stderr and "interpreter" in result.stderr


def test_run_json_with_o_keeps_the_json_and_writes_the_file(canned, tmp_path: Path) -> None:
    canned()
    path = tmp_path / "kernel.py"
    result = invoke("run", TASK, "--json", "--output", str(path))
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["code"] == KERNEL
    assert path.read_text() == KERNEL + "\n"


def test_a_kernel_that_did_not_pass_is_written_with_a_warning(canned, tmp_path: Path) -> None:
    canned(passed=False)
    path = tmp_path / "kernel.py"
    result = invoke("run", TASK, "-o", str(path))
    assert result.exit_code == 1
    assert path.read_text() == KERNEL + "\n"
    assert "did NOT pass verification" in result.stderr


def test_an_unwritable_o_is_refused_before_any_work(canned, tmp_path: Path) -> None:
    canned()
    result = invoke("run", TASK, "-o", str(tmp_path / "missing" / "kernel.py"))
    assert result.exit_code == 2 and "does not exist" in result.stderr
