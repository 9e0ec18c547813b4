"""HTTP clients of the gateway: :class:`AIKGClient` (blocking) and :class:`AsyncAIKGClient`.

``AIKGClient`` keeps the HTTP AIKG client's calls (docs/compatibility.md):
``AIKGClient("http://localhost:8000").submit_job(op_name=..., task_desc=..., job_type=...,
backend=..., arch=..., dsl=..., framework=..., workflow=...)`` returns a job id and
``wait_for_completion(job_id, timeout=1800)`` the final status dict (``status["status"]``,
``status.get("result")``). It adds ``list_jobs``, ``cancel_job``, ``stream_events``
(Server-Sent Events), ``get_kernel``, ``list_kernels`` / ``iter_kernel_pages`` (every
job's kernel with its verdict and provenance, by cursor; ``aikg export`` writes them to
files with :mod:`services.sdk.export`), batch verification (``verify_batch``: many
candidates of one task, identical ones verified once; ``submit_batch``,
``stream_batch_verdicts``, ``get_batch``, ``cancel_batch``) and bearer-token auth.
``AsyncAIKGClient`` has the same methods as coroutines (async iterators for the
streams), and ``verify_batch_stream``.

Each request-answer call is written once, without I/O, in :mod:`services.sdk.calls`;
both clients run it, over ``httpx.Client`` and ``httpx.AsyncClient``. What is their
own is what blocks or awaits: the event streams, the batch wait and the job wait (the
one policy of :class:`~services.sdk.job_wait.JobWait`).

Errors: :class:`AIKGHTTPError` when the gateway refuses a request (its ``status_code``
and ``detail`` say why), :class:`AIKGConnectionError` when it cannot be reached.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
from httpx_sse import ServerSentEvent, aconnect_sse, connect_sse

from services.common.runtime import cancel_and_wait
from services.common.settings import GATEWAY_URL, load_setting
from services.sdk.calls import (
    Calls,
    Request,
    awaitable,
    batch_path,
    blocking,
    in_candidate_order,
    job_path,
    raise_for,
)
from services.sdk.errors import AIKGConnectionError, AIKGError, AIKGHTTPError
from services.sdk.job_wait import EventFeed, JobWait, Progress, follow_events

__all__ = ["AIKGClient", "AIKGConnectionError", "AIKGError", "AIKGHTTPError",
           "AsyncAIKGClient"]

# Event streams send a keepalive comment every ~15 s; a read that waits this long
# without one means the connection is dead.
_STREAM_READ_TIMEOUT_S = 60.0


class AIKGClient:
    """Blocking client of the AIKG gateway (httpx).

    Args:
        url: the gateway's base URL (``http://host:8000``).
        token: bearer token when the gateway has ``AIKG_API_TOKEN`` set; None reads the
            ``AIKG_API_TOKEN`` setting.
        timeout: seconds per HTTP request (waiting for a job is many requests).
    """

    def __init__(self, url: str = GATEWAY_URL, token: str | None = None,
                 timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, headers=_headers(token), timeout=timeout)

    def close(self) -> None:
        """Close the HTTP connections."""
        self._http.close()

    def __enter__(self) -> AIKGClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, request: Request) -> httpx.Response:
        try:
            return raise_for(self._http.request(request.method, request.path,
                                                params=request.params, json=request.json))
        except httpx.TransportError as exc:
            raise _unreachable(self.url, exc) from exc

    submit_job = blocking(Calls.submit_job)
    submit = blocking(Calls.submit)
    get_job_status = blocking(Calls.get_job_status)
    get_queue_position = blocking(Calls.get_queue_position)
    list_jobs = blocking(Calls.list_jobs)
    cancel_job = blocking(Calls.cancel_job)
    get_kernel = blocking(Calls.get_kernel)
    get_workers_status = blocking(Calls.get_workers_status)
    list_kernels = blocking(Calls.list_kernels)
    submit_batch = blocking(Calls.submit_batch)
    get_batch = blocking(Calls.get_batch)
    cancel_batch = blocking(Calls.cancel_batch)

    def iter_kernel_pages(self, passed: bool | None = None, op_name: str | None = None,
                          backend: str | None = None, arch: str | None = None,
                          cursor: str | None = None, limit: int = 100
                          ) -> Iterator[dict[str, Any]]:
        """:meth:`list_kernels` page after page, following ``next_cursor`` until a page
        says no ``more``; the last page's ``next_cursor`` resumes later."""
        while True:
            page = self.list_kernels(passed, op_name, backend, arch, cursor, limit)
            yield page
            cursor = page.get("next_cursor") or cursor
            if not page.get("more"):
                return

    def _stream(self, path: str, last_event_id: int | None) -> Iterator[ServerSentEvent]:
        """The server-sent events of ``path`` (resumed after ``last_event_id``).

        Raises:
            AIKGHTTPError: the gateway answered 4xx/5xx; AIKGConnectionError: unreachable.
        """
        headers, timeout = _stream_options(self._http.timeout, last_event_id)
        try:
            with connect_sse(self._http, "GET", path, headers=headers,
                             timeout=timeout) as source:
                if source.response.status_code >= 400:
                    source.response.read()
                    raise_for(source.response)
                yield from source.iter_sse()
        except httpx.TransportError as exc:
            raise _unreachable(self.url, exc) from exc

    def stream_events(self, job_id: str, last_event_id: int | None = None
                      ) -> Iterator[dict[str, Any]]:
        """The job's events (JobEvent dicts) from its first one, then live; the iterator
        ends after the terminal event (``completed``, ``failed``, ``cancelled``).

        Args:
            last_event_id: resume after this stream sequence (``event["seq"]`` of an
                event this iterator yielded before).

        Each dict also carries ``seq``, the event's stream sequence (for a terminal
        event the gateway rebuilt from the record, the sequence of the event before).
        """
        with contextlib.closing(self._stream(job_path(job_id, "/events"),
                                             last_event_id)) as stream:
            for sse in stream:
                if sse.data:  # a keepalive comment decodes as an empty message
                    yield _event(sse)

    def stream_batch_verdicts(self, batch_id: str, last_event_id: int | None = None
                              ) -> Iterator[dict[str, Any]]:
        """The batch's verdicts (BatchVerdict dicts, each with ``number``: its place in
        the finish order, from 1) as they land; ends once no verdict is awaited.

        Args:
            last_event_id: resume after this ``number``.

        Yields ``{}`` for each keepalive (every ~15 s while idle), so a caller can
        check its own deadline; skip falsy items otherwise.
        """
        with contextlib.closing(self._stream(batch_path(batch_id, "/events"),
                                             last_event_id)) as stream:
            for sse in stream:
                if sse.event == "end":
                    return
                yield _verdict(sse)

    def verify_batch(self, op_name: str, task_desc: str, candidates: list[str], *,
                     timeout: float = 1800, on_verdict: Any = None,
                     cancel_on_interrupt: bool = True, **fields: Any
                     ) -> list[dict[str, Any] | None]:
        """Verify every candidate against the task through the gateway and wait.

        Args:
            candidates: sources, each defining ``ModelNew``; identical ones (same
                normalised AST) are verified once and share the verdict.
            timeout: seconds to wait for the whole batch at most.
            on_verdict: called with each verdict dict as it lands.
            fields: :meth:`submit_batch`'s (``backend``, ``arch``, ``trials``,
                ``timeout_s``, ``shape_overrides``, ``priority``, ``batch_id``).

        Returns:
            One verdict dict per candidate, in the order of ``candidates`` (``passed``,
            ``stage``, ``error``, ``duplicate_of``, timings ...); None for one that got
            none (cancelled before it started).

        Raises:
            TimeoutError: the batch did not end within ``timeout``; it goes on.
            AIKGHTTPError, AIKGConnectionError: as :meth:`submit_batch`.
            KeyboardInterrupt: Ctrl-C; the batch is cancelled first
                (``cancel_on_interrupt``).
        """
        batch_id = self.submit_batch(op_name, task_desc, candidates, **fields)["batch_id"]
        deadline = time.monotonic() + timeout
        try:
            for verdict in self.stream_batch_verdicts(batch_id):
                if verdict and on_verdict is not None:
                    on_verdict(verdict)
                if time.monotonic() > deadline:
                    raise TimeoutError(_batch_timeout(batch_id, timeout))
        except KeyboardInterrupt:
            if cancel_on_interrupt:
                with contextlib.suppress(AIKGError):
                    self.cancel_batch(batch_id)
            raise
        return in_candidate_order(self.get_batch(batch_id))

    def wait_for_completion(self, job_id: str, timeout: float = 1800, poll_interval: float = 1.0,
                            progress: bool = True, *, on_status: Any = None,
                            cancel_on_interrupt: bool = True,
                            unreachable_grace_s: float = 0.0,
                            on_event: Any = None) -> dict[str, Any]:
        """Poll the job until it ends; returns its final status dict.

        Args:
            timeout: seconds to wait at most.
            poll_interval: seconds between status requests.
            progress: show a progress display on stderr when it is a terminal (with
                the phase of the verification under way, from the job's events).
            on_status: called with each status dict received (e.g. a display of one's own).
            on_event: called, in the waiting thread, with each of the job's events as
                it comes (JobEvent dicts, as :meth:`stream_events` yields them: its
                history first; ``verify_phase`` events say what the worker verifying a
                candidate is doing; shown, never a verdict). Given, or with the progress
                display, the events are read beside the status requests.
            cancel_on_interrupt: cancel the job on Ctrl-C before re-raising; False
                leaves it running.
            unreachable_grace_s: seconds the gateway may stay unreachable before the
                wait ends (0: at the first failed request).

        Raises:
            TimeoutError: the job did not end within ``timeout``; it goes on.
            AIKGConnectionError: the gateway stayed unreachable past the grace.
            AIKGHTTPError: the gateway refused the status request (404 unknown job).
            KeyboardInterrupt: Ctrl-C; the job is cancelled first (``cancel_on_interrupt``).
        """
        live = progress and sys.stderr.isatty()
        feed = EventFeed(lambda: self.stream_events(job_id)) if live or on_event else \
            EventFeed(None)
        try:
            with Progress(job_id, live) as display, feed:
                wait = JobWait(job_id, timeout, poll_interval, unreachable_grace_s,
                                [display.update, on_status], time.monotonic,
                                [display.event, on_event])
                while True:
                    try:
                        if wait.ended(status := self.get_job_status(job_id)):
                            return status
                    except AIKGConnectionError as exc:
                        wait.lost(exc)
                    for event in feed.during(wait.pause()):
                        wait.seen(event)
        except KeyboardInterrupt:
            if cancel_on_interrupt:
                with contextlib.suppress(AIKGError):
                    self.cancel_job(job_id)
            raise


class AsyncAIKGClient:
    """:class:`AIKGClient` for asyncio: the same methods, as coroutines.

    ``stream_events`` and ``stream_batch_verdicts`` are async iterators (keepalives
    are not yielded). ``wait_for_completion`` cancels the job when the waiting task is
    cancelled (or on Ctrl-C) and re-raises; ``verify_batch`` and
    ``verify_batch_stream`` cancel the batch likewise.
    """

    def __init__(self, url: str = GATEWAY_URL, token: str | None = None,
                 timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.AsyncClient(base_url=self.url, headers=_headers(token),
                                       timeout=timeout)

    async def aclose(self) -> None:
        """Close the HTTP connections."""
        await self._http.aclose()

    async def __aenter__(self) -> AsyncAIKGClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _send(self, request: Request) -> httpx.Response:
        try:
            return raise_for(await self._http.request(
                request.method, request.path, params=request.params, json=request.json))
        except httpx.TransportError as exc:
            raise _unreachable(self.url, exc) from exc

    submit_job = awaitable(Calls.submit_job)
    submit = awaitable(Calls.submit)
    get_job_status = awaitable(Calls.get_job_status)
    get_queue_position = awaitable(Calls.get_queue_position)
    list_jobs = awaitable(Calls.list_jobs)
    cancel_job = awaitable(Calls.cancel_job)
    get_kernel = awaitable(Calls.get_kernel)
    get_workers_status = awaitable(Calls.get_workers_status)
    list_kernels = awaitable(Calls.list_kernels)
    submit_batch = awaitable(Calls.submit_batch)
    get_batch = awaitable(Calls.get_batch)
    cancel_batch = awaitable(Calls.cancel_batch)

    async def _stream(self, path: str, last_event_id: int | None
                      ) -> AsyncIterator[ServerSentEvent]:
        """See :meth:`AIKGClient._stream`."""
        headers, timeout = _stream_options(self._http.timeout, last_event_id)
        try:
            async with aconnect_sse(self._http, "GET", path, headers=headers,
                                    timeout=timeout) as source:
                if source.response.status_code >= 400:
                    await source.response.aread()
                    raise_for(source.response)
                async for sse in source.aiter_sse():
                    yield sse
        except httpx.TransportError as exc:
            raise _unreachable(self.url, exc) from exc

    async def stream_events(self, job_id: str, last_event_id: int | None = None
                            ) -> AsyncIterator[dict[str, Any]]:
        """See :meth:`AIKGClient.stream_events`."""
        async for sse in self._stream(job_path(job_id, "/events"), last_event_id):
            if sse.data:  # a keepalive comment decodes as an empty message
                yield _event(sse)

    async def stream_batch_verdicts(self, batch_id: str, last_event_id: int | None = None
                                    ) -> AsyncIterator[dict[str, Any]]:
        """See :meth:`AIKGClient.stream_batch_verdicts` (keepalives are not yielded)."""
        async for sse in self._stream(batch_path(batch_id, "/events"), last_event_id):
            if sse.event == "end":
                return
            if sse.data:
                yield _verdict(sse)

    async def verify_batch_stream(self, op_name: str, task_desc: str, candidates: list[str],
                                  **fields: Any) -> AsyncIterator[dict[str, Any]]:
        """Submit a batch (:meth:`submit_batch`'s arguments) and yield each verdict as
        it lands, in the order they finish; ends once no verdict is awaited. The
        batch is cancelled when the iteration is (task cancelled, Ctrl-C)."""
        batch_id = (await self.submit_batch(op_name, task_desc, candidates,
                                            **fields))["batch_id"]
        try:
            async for verdict in self.stream_batch_verdicts(batch_id):
                yield verdict
        except (KeyboardInterrupt, asyncio.CancelledError):
            await self._cancel_quietly(self.cancel_batch(batch_id))
            raise

    async def verify_batch(self, op_name: str, task_desc: str, candidates: list[str], *,
                           timeout: float = 1800, on_verdict: Any = None, **fields: Any
                           ) -> list[dict[str, Any] | None]:
        """See :meth:`AIKGClient.verify_batch`; the batch is cancelled when the waiting
        task is. Raises TimeoutError after ``timeout`` seconds (the batch goes on)."""
        batch_id = (await self.submit_batch(op_name, task_desc, candidates,
                                            **fields))["batch_id"]
        try:
            async with asyncio.timeout(timeout):
                async for verdict in self.stream_batch_verdicts(batch_id):
                    if on_verdict is not None:
                        on_verdict(verdict)
        except TimeoutError:
            raise TimeoutError(_batch_timeout(batch_id, timeout)) from None
        except (KeyboardInterrupt, asyncio.CancelledError):
            await self._cancel_quietly(self.cancel_batch(batch_id))
            raise
        return in_candidate_order(await self.get_batch(batch_id))

    async def wait_for_completion(self, job_id: str, timeout: float = 1800,
                                  poll_interval: float = 1.0, progress: bool = True, *,
                                  on_status: Any = None, cancel_on_interrupt: bool = True,
                                  unreachable_grace_s: float = 0.0,
                                  on_event: Any = None) -> dict[str, Any]:
        """See :meth:`AIKGClient.wait_for_completion` (``on_event`` is called in this
        event loop); the job is also cancelled when the waiting task is
        (``cancel_on_interrupt``)."""
        live = progress and sys.stderr.isatty()
        following: asyncio.Task[None] | None = None
        try:
            with Progress(job_id, live) as display:
                wait = JobWait(job_id, timeout, poll_interval, unreachable_grace_s,
                                [display.update, on_status], asyncio.get_running_loop().time,
                                [display.event, on_event])
                if live or on_event:
                    following = asyncio.create_task(
                        follow_events(self.stream_events(job_id), wait.seen))
                while True:
                    try:
                        if wait.ended(status := await self.get_job_status(job_id)):
                            return status
                    except AIKGConnectionError as exc:
                        wait.lost(exc)
                    await asyncio.sleep(wait.pause())
        except (KeyboardInterrupt, asyncio.CancelledError):
            if cancel_on_interrupt:
                await self._cancel_quietly(self.cancel_job(job_id))
            raise
        finally:
            if following is not None:
                await cancel_and_wait(following)

    @staticmethod
    async def _cancel_quietly(cancel: Any) -> None:
        """Await the ``cancel`` coroutine shielded from the cancellation under way; the
        gateway's errors are dropped (the caller re-raises what stopped it)."""
        with contextlib.suppress(AIKGError):
            await asyncio.shield(cancel)


def _headers(token: str | None) -> dict[str, str]:
    token = token if token is not None else load_setting("api_token") or None
    return {"Authorization": f"Bearer {token}"} if token else {}


def _unreachable(url: Any, exc: Exception) -> AIKGConnectionError:
    reason = str(exc) or exc.__class__.__name__
    return AIKGConnectionError(f"cannot reach the AIKG gateway at {url}: {reason} (is "
                               "`aikg up` or `aikg gateway` running there?)", str(url), reason)


def _stream_options(timeout: httpx.Timeout, last_event_id: int | None
                    ) -> tuple[dict[str, str], httpx.Timeout]:
    """An event stream's request headers (``Last-Event-ID`` to resume) and timeout
    (the client's connect timeout; reads wait for keepalives)."""
    headers = {"Last-Event-ID": str(last_event_id)} if last_event_id else {}
    return headers, httpx.Timeout(timeout.connect, read=_STREAM_READ_TIMEOUT_S)


def _batch_timeout(batch_id: str, timeout: float) -> str:
    return (f"batch {batch_id} did not end within {timeout:g} s; it goes on (get_batch "
            "shows its verdicts)")


def _verdict(sse: ServerSentEvent) -> dict[str, Any]:
    """A batch stream's message: the verdict with its ``number``; ``{}`` for a keepalive."""
    if not sse.data:
        return {}
    verdict = json.loads(sse.data)
    verdict["number"] = int(sse.id) if sse.id else None
    return verdict


def _event(sse: ServerSentEvent) -> dict[str, Any]:
    event = json.loads(sse.data)
    event["seq"] = int(sse.id) if sse.id else None
    return event
