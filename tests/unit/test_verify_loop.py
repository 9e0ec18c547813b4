"""The fast edit-verify loop without a sandbox (services/cli/watch.py): a kernel the
static check refuses gets its verdict from the source, with no sandbox started, and
``--watch`` / ``--max-runs`` refuse what they cannot do. The verdicts beside the
verifier's: tests/sandbox/test_early_refusal.py; ``--watch`` itself:
tests/e2e/test_verify_watch.py."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from services.cli import app
from services.cli.watch import static_refusal, verify_kernel
from services.common.verify_client import build_request
from services.sdk import LocalWorker
from tests.helpers import BUNDLED_RELU_TASK, RELU_KERNEL, TASKS

# RELU_KERNEL with torch doing the work in forward: the static check's S007.
TORCH_IN_FORWARD = RELU_KERNEL.replace("    def forward(self, x):\n",
                                       "    def forward(self, x):\n        x = torch.relu(x)\n")
# Five findings: the error names three and says how many more, the log has them all.
MANY_FINDINGS = TORCH_IN_FORWARD.replace(
    "        x = torch.relu(x)\n",
    "        x = torch.relu(x)\n        x = torch.sigmoid(x)\n        x = torch.tanh(x)\n"
    "        x = torch.exp(x)\n        x = torch.abs(x)\n")


def _request(code: str):
    return build_request(task_desc=BUNDLED_RELU_TASK, code=code, op_name="relu",
                         backend="cpu", arch="x86_64")


def _refusal(code: str):
    return static_refusal(_request(code), worker_id="w", device="0", interpreted=True)


def test_an_honest_kernel_is_left_to_the_sandbox():
    assert "def forward" in TORCH_IN_FORWARD and TORCH_IN_FORWARD != RELU_KERNEL
    assert _refusal(RELU_KERNEL) is None


def test_torch_in_forward_is_stage_static_with_the_rule():
    verdict = _refusal(TORCH_IN_FORWARD)
    assert verdict is not None and not verdict.passed
    assert verdict.stage == "static"
    assert verdict.error.startswith("static check failed: ") and "torch.relu" in verdict.error
    assert verdict.worker_id == "w" and verdict.device == "0" and verdict.interpreted
    assert set(verdict.phases) == {"verdict"}


def test_a_syntax_error_is_stage_compile():
    verdict = _refusal("class ModelNew(:\n")
    assert verdict is not None and verdict.stage == "compile"
    assert "SyntaxError" in verdict.error


def test_more_than_three_findings_are_counted_and_all_logged():
    verdict = _refusal(MANY_FINDINGS)
    assert verdict is not None and verdict.stage == "static"
    shown = verdict.error.count("called in ModelNew.forward")
    logged = verdict.log.count("called in ModelNew.forward")
    assert shown == 3 and logged >= 5
    assert verdict.error.endswith(f"(+{len(verdict.log.splitlines()) - 3} more)")


async def test_a_static_refusal_starts_no_sandbox():
    worker = LocalWorker(["0"], backend="cpu", client_command="aikg verify")
    try:
        verdict = await verify_kernel(worker, BUNDLED_RELU_TASK, TORCH_IN_FORWARD, "relu")
    finally:
        await worker.close()
    assert verdict.stage == "static" and verdict.worker_id == worker.worker_id
    assert worker._verifier is None  # the sandbox was never made, let alone started


RELU = str(TASKS / "relu.py")


def _cli(*args: str):
    return CliRunner().invoke(app, ["verify", *args], env={"COLUMNS": "100"})


def test_the_cli_answers_a_static_refusal_with_the_verdict(tmp_path: Path):
    kernel = tmp_path / "k.py"
    kernel.write_text(TORCH_IN_FORWARD)
    result = _cli(RELU, str(kernel), "--json")
    assert result.exit_code == 1, result.output
    verdict = json.loads(result.stdout)
    assert verdict["stage"] == "static" and "torch.relu" in verdict["error"]
    assert "sandbox_start" not in verdict["phases"]


def test_watch_takes_one_local_kernel(tmp_path: Path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text(RELU_KERNEL)
    b.write_text(RELU_KERNEL)
    two = _cli(RELU, str(a), str(b), "--watch")
    assert two.exit_code == 2 and "--watch verifies one kernel" in two.output
    gateway = _cli(RELU, str(a), "--watch", "--gateway", "http://127.0.0.1:9")
    assert gateway.exit_code == 2 and "no --gateway" in gateway.output
    alone = _cli(RELU, str(a), "--max-runs", "2")
    assert alone.exit_code == 2 and "--max-runs goes with --watch" in alone.output
