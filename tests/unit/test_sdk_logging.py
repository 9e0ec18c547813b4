"""The SDK is silent unless the application configures logging (the library convention):
a script that uses it prints only what it prints itself; ``logging.basicConfig`` shows the
SDK's records; the services' structlog set-up keeps their output. Each case is a child
process, as a user's script is (structlog's configuration is process-wide).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import scaled

ROOT = Path(__file__).resolve().parents[2]

# Events of the kinds the SDK's code paths log: structlog under aikg.* (the verifier,
# the bus, the verdict reader), stdlib aikg.sdk (RemoteWorker).
EMIT = """
import logging, structlog
structlog.get_logger("aikg.worker").info("verify.done", passed=True)
structlog.get_logger("aikg.bus").warning("nats_error", error="boom")
structlog.get_logger("aikg.verdicts").error("verdict_rejected", reason="bad_proof")
logging.getLogger("aikg.sdk").warning("NATS: %s", "gone")
"""


def run(code: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("AIKG_")}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, env={**clean, "PYTHONPATH": str(ROOT)},
                          timeout=scaled(120))


def test_the_sdk_prints_nothing_by_default() -> None:
    done = run("import services.sdk\n" + EMIT)
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == ("", "")


def test_an_application_that_configures_logging_sees_the_sdks_records() -> None:
    done = run("import logging, services.sdk\nlogging.basicConfig(level=logging.INFO)\n" + EMIT)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    for text in ("event='verify.done' passed=True", "event='nats_error' error='boom'",
                 "event='verdict_rejected' reason='bad_proof'", "NATS: gone"):
        assert text in done.stderr, done.stderr


def test_the_services_logging_is_kept_with_the_sdk_imported() -> None:
    """A service (or the CLI) configures structlog itself, before or after importing the
    SDK: its JSON lines still go to stderr."""
    for order in ("import services.sdk\nconfigure_logging('worker', 'info', 'json')\n",
                  "configure_logging('worker', 'info', 'json')\nimport services.sdk\n"):
        done = run("from services.common.logging import configure_logging\n" + order + EMIT)
        assert done.returncode == 0, done.stderr
        events = [json.loads(line)["event"] for line in done.stderr.splitlines()
                  if line.startswith("{")]
        assert events[:3] == ["verify.done", "nats_error", "verdict_rejected"], done.stderr


@pytest.mark.slow
def test_a_local_worker_script_prints_only_its_own_output() -> None:
    """LocalWorker starts a sandbox and verifies a kernel (it logs verifier.started and
    verify.done): the script's stdout holds its own line only, stderr nothing."""
    done = run(
        "import asyncio\n"
        "from services.sdk import LocalWorker\n"
        "from tests.helpers import BUNDLED_RELU_TASK, RELU_KERNEL\n"
        "async def main():\n"
        "    worker = LocalWorker([0], backend='cpu')\n"
        "    try:\n"
        "        return await worker.verify(BUNDLED_RELU_TASK, RELU_KERNEL, 'relu', trials=1)\n"
        "    finally:\n"
        "        await worker.close()\n"
        "print('passed', asyncio.run(main()).passed)\n")
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == ("passed True\n", "")
