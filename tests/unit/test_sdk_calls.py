"""services/sdk/calls.py: each gateway call written once, run by both clients."""

from __future__ import annotations

import asyncio
import inspect

import httpx
import pytest

from services.sdk.calls import Calls, Request, run_async, run_blocking
from services.sdk.client import AIKGClient, AsyncAIKGClient
from services.sdk.errors import AIKGHTTPError

CALLS = [name for name, value in vars(Calls).items() if inspect.isgeneratorfunction(value)]


@pytest.mark.parametrize("name", CALLS)
def test_both_clients_run_every_call_with_its_signature(name):
    blocking, awaitable = getattr(AIKGClient, name), getattr(AsyncAIKGClient, name)
    assert not inspect.isgeneratorfunction(blocking)
    assert inspect.iscoroutinefunction(awaitable)
    assert inspect.signature(blocking) == inspect.signature(awaitable)
    assert "Call[" not in str(inspect.signature(blocking))
    assert blocking.__doc__ == awaitable.__doc__ == getattr(Calls, name).__doc__


def _answer(request: Request) -> httpx.Response:
    if request.path.endswith("/kernel"):
        raise AIKGHTTPError(404, "job j has no kernel yet")
    return httpx.Response(200, json={"queue_position": 3, "estimated_start_time": None,
                                     "path": request.path})


def test_a_call_is_the_same_blocking_and_awaited():
    async def send(request: Request) -> httpx.Response:
        return _answer(request)

    for run, sender in ((run_blocking, _answer),
                        (lambda s, c: asyncio.run(run_async(s, c)), send)):
        assert run(sender, Calls.get_queue_position(None, "a/b")) == (3, None)
        # The client's error is thrown into the call, which may turn it into an answer.
        assert run(sender, Calls.get_kernel(None, "j")) is None
        assert run(sender, Calls.get_job_status(None, "a/b"))["path"] == \
            "/api/v1/jobs/a%2Fb/status"
