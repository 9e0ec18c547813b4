"""One job can be followed across the gateway, generator and worker logs by its id.

The three services run in this event loop with :func:`configure_logging` writing
JSON to a file; every line that mentions the job must carry ``job_id``, and the
worker's lines about it also ``worker_id``, ``request_id`` and ``candidate_id``.
In one process ``service`` is the same
for all three, so the ``logger`` name (``aikg.gateway``, ``aikg.generator``,
``aikg.worker`` ...) tells them apart.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import structlog

from services.common.bus import Bus
from services.common.logging import configure_logging
from services.common.settings import Settings
from tests.conftest import running_gateway
from tests.helpers import RELU_KERNEL, RELU_TASK, scaled, wait_terminal

JOB_ID = "follow-me-relu"
WORKER_IDS = ("worker_id", "request_id", "candidate_id")


@pytest.fixture
def log_file(tmp_path: Path) -> Iterator[Path]:
    """structlog JSON to a file for the test; the previous configuration after."""
    saved = structlog.get_config()
    path = tmp_path / "services.log"
    with path.open("w", buffering=1) as stream:
        configure_logging("aikg", level="info", fmt="json", stream=stream)
        try:
            yield path
        finally:
            structlog.configure(**saved)
            structlog.contextvars.clear_contextvars()


def test_configure_logging_writes_json_with_bound_ids() -> None:
    saved = structlog.get_config()
    out = io.StringIO()
    try:
        configure_logging("worker", fmt="json", stream=out)
        with structlog.contextvars.bound_contextvars(job_id="j1", request_id="r1"):
            structlog.get_logger("aikg.worker").info("verify_started", device="0")
    finally:
        structlog.configure(**saved)
        structlog.contextvars.clear_contextvars()
    event = json.loads(out.getvalue())
    assert event["event"] == "verify_started" and event["level"] == "info"
    assert event["service"] == "worker" and event["logger"] == "aikg.worker"
    assert event["job_id"] == "j1" and event["request_id"] == "r1" and event["timestamp"]


@pytest.mark.slow
async def test_one_job_is_followed_across_the_services_by_its_id(
        shared_services, settings: Settings, bus: Bus, log_file: Path) -> None:
    async with shared_services(settings, bus), running_gateway(settings) as url:
        async with httpx.AsyncClient(base_url=url, timeout=scaled(15)) as client:
            resp = await client.post("/api/v1/jobs/submit", json={
                "op_name": "relu", "task_desc": RELU_TASK, "backend": "cpu",
                "job_id": JOB_ID, "init_code": RELU_KERNEL, "trials": 1})
            assert resp.status_code == 200, resp.text
            final = await wait_terminal(client, JOB_ID)
        assert final["status"] == "completed", final

    lines = [line for line in log_file.read_text().splitlines() if JOB_ID in line]
    assert lines, "no log line mentions the job"
    events = []
    for line in lines:
        event = json.loads(line)  # every line about the job is one JSON event
        assert event.get("job_id") == JOB_ID, f"line mentions the job without job_id: {line}"
        events.append(event)

    by_service = {name: [e for e in events if e.get("logger", "").startswith(f"aikg.{name}")]
                  for name in ("gateway", "generator", "worker")}
    assert all(by_service.values()), {k: len(v) for k, v in by_service.items()}
    unbound = [e for e in by_service["worker"] if any(not e.get(k) for k in WORKER_IDS)]
    assert unbound == [], f"worker events about the job without {WORKER_IDS}: {unbound}"
    # The worker's request and candidate ids are those the generator asked for.
    asked = {(e["request_id"], e["candidate_id"]) for e in by_service["generator"]
             if e.get("request_id") and e.get("candidate_id")}
    ran = {(e["request_id"], e["candidate_id"]) for e in by_service["worker"]}
    assert asked and ran <= asked, (asked, ran)
