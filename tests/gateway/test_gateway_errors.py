"""The gateway's error mapping: NATS trouble is 503 with ``Retry-After`` by one handler.

In-process over ASGI (Litestar's test client); the first test needs no NATS at all,
the second meets a real nats-server's "no responders" answer.
"""

from __future__ import annotations

from litestar import get
from litestar.datastructures import State
from litestar.testing import AsyncTestClient

from services.common.bus import Bus
from services.common.settings import Settings, load_settings
from services.gateway.app import create_app
from services.gateway.errors import NATS_TROUBLE
from tests.helpers import scaled


async def test_routes_answer_503_before_nats_is_connected() -> None:
    """Without a bus (the app's lifespan has not connected one) every /api/v1 route is
    503 with Retry-After from the ``bus`` dependency; probes still answer."""
    app = create_app(load_settings(env={}))
    # Not entered as a context manager: the lifespan (which connects NATS) does not run.
    client = AsyncTestClient(app)
    for method, path in (("GET", "/api/v1/jobs"), ("GET", "/api/v1/workers"),
                         ("GET", "/api/v1/kernels"), ("GET", "/api/v1/jobs/job-1/status"),
                         ("POST", "/api/v1/jobs/job-1/cancel")):
        r = await client.request(method, path)
        assert r.status_code == 503, (path, r.text)
        assert r.headers["retry-after"] == "2"
        assert r.json() == {"status_code": 503,
                            "detail": "gateway is not connected to NATS yet; retry"}
    assert (await client.get("/healthz")).status_code == 200
    ready = await client.get("/readyz")
    assert ready.status_code == 503 and ready.json()["reason"] == "not connected to NATS yet"


async def test_nats_error_raised_in_a_route_is_503_naming_the_route(
    settings: Settings, bus: Bus
) -> None:
    """A NATS failure that escapes a route (here a real request nobody answers: the
    server says "no responders" or the request times out) is answered 503 with
    Retry-After by the app's exception handler, not 500."""

    @get("/nobody-answers")
    async def nobody_answers(state: State) -> str:
        await state.bus.nc.request("aikg.test.nobody", b"", timeout=scaled(0.5))
        return "unreachable"

    app = create_app(settings, bus)
    app.register(nobody_answers)
    async with AsyncTestClient(app) as client:
        r = await client.get("/nobody-answers")
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == "2"
    detail = r.json()["detail"]
    assert "GET /nobody-answers" in detail
    assert any(f"({cls.__name__};" in detail for cls in NATS_TROUBLE), detail
    assert "retry shortly" in detail
