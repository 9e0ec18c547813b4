"""Property-based run against the gateway's own OpenAPI spec: no input gets a 5xx.

Schemathesis reads ``/schema/openapi.json`` from the app and sends generated requests
(valid and invalid bodies, queries, path ids, headers) to every operation, in-process
over ASGI; the app is connected to a real nats-server and one (fake) live worker, so
submissions that pass validation are really recorded and published. Hypothesis is
derandomized: every run sends the same requests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from schemas import JobEvent, JobSubmit, WorkerInfo, encode
from services.common.bus import JobStore, connect_bus
from services.common.jobs import cancel_job, new_record, publish_event
from services.common.nats_auth import BusCredentials
from services.common.settings import Settings, load_settings
from services.gateway.app import create_app
from tests.helpers import BUNDLED_RELU_TASK

pytestmark = pytest.mark.slow

EXAMPLES_PER_OPERATION = 100
KNOWN_JOB = "fuzz-known-job"
RELU_TASK = BUNDLED_RELU_TASK


def _with_real_task(case):
    if isinstance(case.body, dict):
        case.body["task_desc"] = RELU_TASK
    return case


@pytest.fixture
def fuzz_settings(nats_url: str, bus_credentials: BusCredentials) -> Settings:
    # A long heartbeat period: the fake worker's key must outlive the run (TTL 3 periods).
    return load_settings(env={}, nats_url=nats_url, worker_heartbeat_s=600.0, metrics_port=-1,
                         log_format="console", log_level="error",
                         **bus_credentials.role_settings())


def _operations() -> list[tuple[str, str]]:
    """(method, path) of every operation in the spec (from an app that is not started),
    sorted: the spec's own order varies between processes, and pytest-xdist needs every
    worker to collect the same tests in the same order."""
    spec = create_app(load_settings(env={})).openapi_schema.to_schema()
    return sorted((method.upper(), path) for path, item in spec["paths"].items()
                  for method in item)


@pytest.fixture
def api_schema(fuzz_settings: Settings) -> Iterator[schemathesis.schemas.BaseSchema]:
    """The served spec, loaded over ASGI from an app connected to the test's NATS."""

    async def live_worker_and_job() -> None:
        bus = await connect_bus(fuzz_settings, "fuzz-setup")
        try:
            info = WorkerInfo(worker_id="fuzz-cpu", backend="cpu", arch="x86_64",
                              devices=["0"], capacity=1)
            await bus.workers.put(info.worker_id, encode(info))
            record = new_record(JobSubmit(op_name="relu", task_desc=RELU_TASK, job_id=KNOWN_JOB),
                                arch="x86_64")
            await JobStore(bus.jobs).create(record)
            await publish_event(bus, JobEvent(job_id=KNOWN_JOB, event="submitted",
                                              status="pending"))
            await cancel_job(bus, KNOWN_JOB)  # ended: its event stream ends too
        finally:
            await bus.close()

    asyncio.run(live_worker_and_job())
    app = create_app(fuzz_settings)
    yield schemathesis.openapi.from_asgi("/schema/openapi.json", app)
    from schemathesis.python import asgi

    asgi.shutdown_lifespans()  # closes the app's NATS connection before the server goes


@pytest.mark.parametrize(("method", "path"), _operations(), ids=lambda v: v)
def test_no_input_gets_a_server_error(api_schema, method: str, path: str) -> None:
    operation = next(op.ok() for op in api_schema.get_all_operations()
                     if op.ok().method.upper() == method and op.ok().path == path)
    strategies = [operation.as_strategy(GenerationMode.POSITIVE),
                  operation.as_strategy(GenerationMode.NEGATIVE)]
    if "{job_id}" in path:
        # Random ids only reach the 404 branch; the known (ended) job reaches the rest.
        strategies.append(operation.as_strategy(GenerationMode.POSITIVE,
                                                path_parameters={"job_id": KNOWN_JOB}))
    if method == "POST" and "submit" in path or (method, path) in (
            ("POST", "/api/v1/jobs"), ("POST", "/api/v1/verify/batch")):
        # Random task sources stop at the task check; a real one goes on to the worker
        # check, the record and the publish, with every other field generated.
        strategies.append(operation.as_strategy(GenerationMode.POSITIVE).map(_with_real_task))
    cases = st.one_of(strategies)

    @given(case=cases)
    @settings(max_examples=EXAMPLES_PER_OPERATION, derandomize=True, database=None,
              deadline=None, suppress_health_check=list(HealthCheck), phases=[Phase.generate])
    def no_server_error(case) -> None:
        response = case.call()
        assert response.status_code < 500, (
            f"{case.method} {case.formatted_path} -> {response.status_code}: "
            f"{response.text[:500]}")

    no_server_error()
