"""``aikg verify --watch`` as a user runs it: a real subprocess verifying a kernel file
again on every save of it or of its task, in one warm sandbox, until ``--max-runs`` or
Ctrl-C; and a static refusal answered without importing torch."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

from tests.e2e.test_cli_more import AIKG, ROOT, aikg
from tests.helpers import BUNDLED_RELU_TASK, RELU_KERNEL, scaled
from tests.unit.test_verify_loop import TORCH_IN_FORWARD


async def _watch(tmp_path: Path, kernel_source: str, *extra: str):
    """``aikg verify TASK KERNEL --watch --json EXTRA`` on copies in ``tmp_path``, its
    scratch under ``tmp_path/tmp``; returns the process and both files."""
    task, kernel, scratch = tmp_path / "relu.py", tmp_path / "kernel.py", tmp_path / "tmp"
    task.write_text(BUNDLED_RELU_TASK)
    kernel.write_text(kernel_source)
    scratch.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIKG_")}
    proc = await asyncio.create_subprocess_exec(
        *AIKG, "verify", str(task), str(kernel), "--watch", "--json", "--trials", "1", *extra,
        env={**env, "TMPDIR": str(scratch)}, cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    return proc, task, kernel


async def _verdict(proc: asyncio.subprocess.Process, timeout_s: float) -> dict:
    line = await asyncio.wait_for(proc.stdout.readline(), scaled(timeout_s))
    if not line:
        _, err = await proc.communicate()
        raise AssertionError(f"--watch ended without a verdict: {err.decode()[-3000:]}")
    return json.loads(line)


async def test_watch_verifies_again_on_every_save_until_max_runs(tmp_path):
    proc, task, kernel = await _watch(tmp_path, RELU_KERNEL, "--max-runs", "4")
    try:
        first = await _verdict(proc, 240)  # the sandbox starts: seconds
        assert first["passed"], first
        kernel.write_text(TORCH_IN_FORWARD)
        refused = await _verdict(proc, 60)
        assert refused["stage"] == "static" and "torch.relu" in refused["error"]
        kernel.write_text(RELU_KERNEL)
        again = await _verdict(proc, 60)
        assert again["passed"], again
        # The same warm sandbox: the same worker, and no sandbox start on the way.
        assert again["worker_id"] == first["worker_id"]
        assert "sandbox_start" not in again["phases"]
        task.write_text(BUNDLED_RELU_TASK + "\n# edited\n")  # the task's save counts too
        last = await _verdict(proc, 60)
        assert last["passed"] and last["request_id"] != again["request_id"]
        code = await asyncio.wait_for(proc.wait(), scaled(60))
        assert code == 0  # the last verdict's code
        assert list((tmp_path / "tmp").iterdir()) == []  # the sandbox's scratch went with it
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_ctrl_c_stops_watching_with_130(tmp_path):
    proc, _, _ = await _watch(tmp_path, TORCH_IN_FORWARD)
    try:
        refused = await _verdict(proc, 60)  # from the source, the sandbox still warming
        assert refused["stage"] == "static"
        proc.send_signal(signal.SIGINT)
        code = await asyncio.wait_for(proc.wait(), scaled(60))
        err = (await proc.stderr.read()).decode()
        assert code == 130, err[-3000:]
        assert "stopped watching" in err and "Traceback" not in err
        assert list((tmp_path / "tmp").iterdir()) == []
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_a_static_refusal_needs_no_torch(tmp_path):
    """With a ``torch`` on the path whose import fails, ``aikg verify`` still refuses
    the kernel that calls torch in forward: the verdict comes from the source alone."""
    kernel = tmp_path / "kernel.py"
    kernel.write_text(TORCH_IN_FORWARD)
    poisoned = tmp_path / "poison"
    (poisoned / "torch").mkdir(parents=True)
    (poisoned / "torch" / "__init__.py").write_text(
        "raise ImportError('torch imported by a refusal that needs only the source')\n")
    code, out, err = await aikg("verify", "tasks/relu.py", str(kernel), "--json",
                                env={"PYTHONPATH": str(poisoned)})
    assert code == 1, err
    verdict = json.loads(out)
    assert verdict["stage"] == "static" and "torch.relu" in verdict["error"]
    assert "torch imported" not in out + err
