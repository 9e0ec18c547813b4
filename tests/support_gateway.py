"""Fixtures of the gateway tests that talk to it over HTTP: a client of the test's
gateway, a submission body, and a worker heartbeat so that submissions are routed.
A test module takes them by naming them at its top level
(``client = support_gateway.client``)."""

from __future__ import annotations

import httpx
import pytest

from services.common.bus import Bus
from tests.helpers import scaled


@pytest.fixture
def job(relu_task: str):
    """``job(**fields)``: a valid submission body with ``fields`` changed (None drops one)."""

    def make(**fields: object) -> dict[str, object]:
        body = {"op_name": "relu", "task_desc": relu_task, **fields}
        return {k: v for k, v in body.items() if v is not None}

    return make


@pytest.fixture
async def client(gateway: str) -> httpx.AsyncClient:
    """An HTTP client of the test's gateway."""
    async with httpx.AsyncClient(base_url=gateway, timeout=scaled(10.0)) as c:
        yield c


@pytest.fixture
async def cpu_worker(bus: Bus, fake_worker_heartbeat) -> None:
    """A live cpu worker's heartbeat, so the gateway routes submissions."""
    await fake_worker_heartbeat(bus, "cpu", "x86_64")
