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
from urllib.parse import quote

import httpx
from httpx_sse import aconnect_sse, connect_sse

from services.common.settings import GATEWAY_URL, load_setting
from services.sdk.errors import AIKGConnectionError, AIKGError, AIKGHTTPError
from services.sdk.job_wait import JobWait, Progress

# Event streams send a keepalive comment every ~15 s; a read that waits this long
# without one means the connection is dead.
_STREAM_READ_TIMEOUT_S = 60.0


def _submit_body(op_name: str, task_desc: str, fields: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {"op_name": op_name, "task_desc": task_desc}
    body.update({k: v for k, v in fields.items() if v is not None})
    return body


def _raise_for(response: httpx.Response) -> httpx.Response:
    if response.status_code < 400:
        return response
    try:
        body = response.json()
    except ValueError:
        body = None
    detail = body.get("detail") if isinstance(body, dict) else None
    raise AIKGHTTPError(response.status_code,
                        str(detail or response.text.strip() or response.reason_phrase), body)


def _kernel_params(passed: bool | None, op_name: str | None, backend: str | None,
                   arch: str | None, cursor: str | None, limit: int) -> dict[str, Any]:
    params: dict[str, Any] = {"limit": limit}
    if passed is not None:
        params["passed"] = "true" if passed else "false"
    params.update({k: v for k, v in (("op_name", op_name), ("backend", backend),
                                     ("arch", arch), ("cursor", cursor)) if v is not None})
    return params


def _path(job_id: str, suffix: str = "") -> str:
    return f"/api/v1/jobs/{quote(job_id, safe='')}{suffix}"


def _batch_path(batch_id: str, suffix: str = "") -> str:
    return f"/api/v1/verify/batch/{quote(batch_id, safe='')}{suffix}"


def _batch_body(op_name: str, task_desc: str, candidates: list[str],
                fields: dict[str, Any]) -> dict[str, Any]:
    return {"op_name": op_name, "task_desc": task_desc, "candidates": list(candidates),
            **{k: v for k, v in fields.items() if v is not None}}


def _in_candidate_order(record: dict[str, Any]) -> list[dict[str, Any] | None]:
    """A batch record's verdicts by candidate index (None: a candidate without one,
    e.g. cancelled before it started)."""
    verdicts: list[dict[str, Any] | None] = [None] * len(record["candidates"])
    for verdict in record["verdicts"]:
        verdicts[verdict["index"]] = verdict
    return verdicts


def _headers(token: str | None) -> dict[str, str]:
    token = token if token is not None else load_setting("api_token") or None
    return {"Authorization": f"Bearer {token}"} if token else {}


def _unreachable(url: Any, exc: Exception) -> AIKGConnectionError:
    reason = str(exc) or exc.__class__.__name__
    return AIKGConnectionError(f"cannot reach the AIKG gateway at {url}: {reason} (is "
                               "`aikg up` or `aikg gateway` running there?)", str(url), reason)


class AIKGClient:
    """Blocking client of the AIKG gateway (httpx).

    Args:
        url: the gateway's base URL (``http://host:8000``).
        token: bearer token when the gateway has ``AIKG_API_TOKEN`` set; None reads the
            ``AIKG_API_TOKEN`` environment variable.
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

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return _raise_for(self._http.request(method, path, **kwargs))
        except httpx.TransportError as exc:
            raise _unreachable(self.url, exc) from exc

    def submit_job(
        self,
        op_name: str,
        task_desc: str,
        job_type: str = "single",
        backend: str | None = None,
        arch: str | None = None,
        dsl: str | None = None,
        framework: str = "torch",
        workflow: str | None = None,
        max_rounds: int | None = None,
        parallel_num: int | None = None,
        num_islands: int | None = None,
        migration_interval: int | None = None,
        elite_size: int | None = None,
        parent_selection_prob: float | None = None,
        init_code: str | None = None,
        shape_overrides: dict[str, Any] | None = None,
        coder: str | None = None,
        job_id: str | None = None,
        priority: str | None = None,
        **fields: Any,
    ) -> str:
        """Submit a job; returns its id.

        Arguments are the reference client's (and the JobSubmit wire fields); None
        leaves a field to the gateway's default (backend ``cpu``, any live arch, dsl
        ``triton``, workflow ``coder_only_workflow``, priority ``normal``). ``priority``
        (``low`` | ``normal`` | ``high``) orders the job among waiting ones, within
        the tenant's ``max_priority``. ``fields`` passes further JobSubmit fields
        (``max_attempts``, ``timeout_s`` seconds, ``trials``).

        Raises:
            AIKGHTTPError: 400 (the detail names the bad field), 409 (no live worker
                for backend/arch; ``body["live"]`` lists the live pairs), 413, 401;
                403 or 429 over a tenant limit (``body["limit"]`` names it; a 429's
                ``Retry-After`` header says when to retry).
            AIKGConnectionError: the gateway is unreachable.
        """
        return self.submit(
            op_name, task_desc, job_type=job_type, backend=backend, arch=arch, dsl=dsl,
            framework=framework, workflow=workflow, max_rounds=max_rounds,
            parallel_num=parallel_num, num_islands=num_islands,
            migration_interval=migration_interval, elite_size=elite_size,
            parent_selection_prob=parent_selection_prob, init_code=init_code,
            shape_overrides=shape_overrides, coder=coder, job_id=job_id, priority=priority,
            **fields)["job_id"]

    def submit(self, op_name: str, task_desc: str, **fields: Any) -> dict[str, Any]:
        """Submit a job; returns the gateway's whole answer: ``job_id``, ``status``,
        ``backend``, ``arch`` (the one it routed to, or None) and ``message``.

        ``fields`` are JobSubmit wire fields; None leaves one to the gateway's default.

        Raises:
            AIKGHTTPError, AIKGConnectionError: as :meth:`submit_job`.
        """
        return self._request("POST", "/api/v1/jobs/submit",
                             json=_submit_body(op_name, task_desc, fields)).json()

    def get_job_status(self, job_id: str) -> dict[str, Any]:
        """The job record: ``status``, ``job_type``, ``op_name``, ``submit_time``,
        ``result`` (``code``, ``verdict``), ``error``, ``progress``, ``tenant``,
        ``priority``; while it waits, ``queue_position`` (1: next) and
        ``estimated_start_time`` (RFC 3339, or None without a recent throughput).

        Raises:
            AIKGHTTPError: 404 for an unknown job.
        """
        return self._request("GET", _path(job_id, "/status")).json()

    def get_queue_position(self, job_id: str) -> tuple[int | None, str | None]:
        """``(queue_position, estimated_start_time)`` of a waiting job; ``(None, None)``
        once it has started (or when the gateway cannot tell).

        Raises:
            AIKGHTTPError: 404 for an unknown job.
        """
        record = self.get_job_status(job_id)
        return record.get("queue_position"), record.get("estimated_start_time")

    def list_jobs(self, status: str | None = None, op_name: str | None = None,
                  limit: int = 50, offset: int = 0, tenant: str | None = None
                  ) -> dict[str, Any]:
        """Job summaries, newest first: ``{"jobs": [...], "total", "limit", "offset"}``;
        waiting jobs carry ``queue_position`` and ``estimated_start_time``."""
        params = {k: v for k, v in (("status", status), ("op_name", op_name),
                                    ("tenant", tenant)) if v is not None}
        return self._request("GET", "/api/v1/jobs",
                             params={**params, "limit": limit, "offset": offset}).json()

    def cancel_job(self, job_id: str) -> dict[str, Any]:
        """Cancel the job; returns its record (unchanged when it had already ended)."""
        return self._request("POST", _path(job_id, "/cancel")).json()

    def get_kernel(self, job_id: str) -> str | None:
        """The job's kernel source, or None while it has none."""
        try:
            return self._request("GET", _path(job_id, "/kernel")).text
        except AIKGHTTPError as exc:
            if exc.status_code == 404 and "no kernel yet" in exc.detail:
                return None
            raise

    def get_workers_status(self) -> dict[str, Any]:
        """Live workers: ``{"workers": [{backend, arch, devices, capacity, in_flight,
        load, leases, ...}]}``."""
        return self._request("GET", "/api/v1/workers/status").json()

    def list_kernels(self, passed: bool | None = None, op_name: str | None = None,
                     backend: str | None = None, arch: str | None = None,
                     cursor: str | None = None, limit: int = 100) -> dict[str, Any]:
        """One page of kernels (``GET /api/v1/kernels``): ``{"kernels": [KernelRow
        dicts], "next_cursor": str, "more": bool}``, ordered by the job's end time.

        Args:
            passed: only kernels that passed (True) or failed (False); None: both.
            cursor: the ``next_cursor`` of an earlier page (None: from the first).
            limit: rows per page, 1 to 500.

        Raises:
            AIKGHTTPError: 400 for a cursor the gateway did not send or a bad limit.
        """
        return self._request("GET", "/api/v1/kernels", params=_kernel_params(
            passed, op_name, backend, arch, cursor, limit)).json()

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
        headers = {"Last-Event-ID": str(last_event_id)} if last_event_id else {}
        timeout = httpx.Timeout(self._http.timeout.connect, read=_STREAM_READ_TIMEOUT_S)
        try:
            with connect_sse(self._http, "GET", _path(job_id, "/events"), headers=headers,
                             timeout=timeout) as source:
                _raise_for_stream(source.response)
                for sse in source.iter_sse():
                    if sse.data:  # a keepalive comment decodes as an empty message
                        yield _event(sse)
        except httpx.TransportError as exc:
            raise _unreachable(self.url, exc) from exc

    def submit_batch(self, op_name: str, task_desc: str, candidates: list[str], *,
                     backend: str | None = None, arch: str | None = None,
                     shape_overrides: dict[str, Any] | None = None, trials: int | None = None,
                     timeout_s: float | None = None, priority: str | None = None,
                     batch_id: str | None = None, **fields: Any) -> dict[str, Any]:
        """Submit a batch verification (``POST /api/v1/verify/batch``); returns the
        gateway's answer: ``batch_id``, ``status``, ``candidates``, ``unique`` (verify
        requests sent: candidates less duplicates), ``backend``, ``arch``.

        ``trials`` and ``timeout_s`` (seconds) apply to each verification; None leaves
        a field to the gateway's default.

        Raises:
            AIKGHTTPError: 400 bad body (empty or too many candidates, a candidate not
                a string), 403/429 a tenant limit (candidates count as jobs), 409 no
                live worker or a taken ``batch_id``.
            AIKGConnectionError: the gateway is unreachable.
        """
        body = _batch_body(op_name, task_desc, candidates, {
            "backend": backend, "arch": arch, "shape_overrides": shape_overrides,
            "trials": trials, "timeout_s": timeout_s, "priority": priority,
            "batch_id": batch_id, **fields})
        return self._request("POST", "/api/v1/verify/batch", json=body).json()

    def get_batch(self, batch_id: str) -> dict[str, Any]:
        """The batch's record: ``status``, ``task``, ``candidates`` and ``verdicts`` (in
        the order they finished).

        Raises:
            AIKGHTTPError: 404 for an unknown batch (or another tenant's).
        """
        return self._request("GET", _batch_path(batch_id)).json()

    def cancel_batch(self, batch_id: str) -> dict[str, Any]:
        """Cancel the batch: what no worker has started is not verified; returns the
        record."""
        return self._request("POST", _batch_path(batch_id, "/cancel")).json()

    def stream_batch_verdicts(self, batch_id: str, last_event_id: int | None = None
                              ) -> Iterator[dict[str, Any]]:
        """The batch's verdicts (BatchVerdict dicts, each with ``number``: its place in
        the finish order, from 1) as they land; ends once no verdict is awaited.

        Args:
            last_event_id: resume after this ``number``.

        Yields ``{}`` for each keepalive (every ~15 s while idle), so a caller can
        check its own deadline; skip falsy items otherwise.
        """
        headers = {"Last-Event-ID": str(last_event_id)} if last_event_id else {}
        timeout = httpx.Timeout(self._http.timeout.connect, read=_STREAM_READ_TIMEOUT_S)
        try:
            with connect_sse(self._http, "GET", _batch_path(batch_id, "/events"),
                             headers=headers, timeout=timeout) as source:
                _raise_for_stream(source.response)
                for sse in source.iter_sse():
                    if sse.event == "end":
                        return
                    yield _verdict(sse)
        except httpx.TransportError as exc:
            raise _unreachable(self.url, exc) from exc

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
                    raise TimeoutError(f"batch {batch_id} did not end within {timeout:g} s; "
                                       "it goes on (get_batch shows its verdicts)")
        except KeyboardInterrupt:
            if cancel_on_interrupt:
                with contextlib.suppress(AIKGError):
                    self.cancel_batch(batch_id)
            raise
        return _in_candidate_order(self.get_batch(batch_id))

    def wait_for_completion(self, job_id: str, timeout: float = 1800, poll_interval: float = 1.0,
                            progress: bool = True, *, on_status: Any = None,
                            cancel_on_interrupt: bool = True,
                            unreachable_grace_s: float = 0.0) -> dict[str, Any]:
        """Poll the job until it ends; returns its final status dict.

        Args:
            timeout: seconds to wait at most.
            poll_interval: seconds between status requests.
            progress: show a progress display on stderr when it is a terminal.
            on_status: called with each status dict received (e.g. a display of one's own).
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
        try:
            with Progress(job_id, progress and sys.stderr.isatty()) as display:
                wait = JobWait(job_id, timeout, poll_interval, unreachable_grace_s,
                                [display.update, on_status], time.monotonic)
                while True:
                    try:
                        if wait.ended(status := self.get_job_status(job_id)):
                            return status
                    except AIKGConnectionError as exc:
                        wait.lost(exc)
                    time.sleep(wait.pause())
        except KeyboardInterrupt:
            if cancel_on_interrupt:
                with contextlib.suppress(AIKGError):
                    self.cancel_job(job_id)
            raise


class AsyncAIKGClient:
    """:class:`AIKGClient` for asyncio: the same methods, as coroutines.

    ``stream_events`` is an async iterator. ``wait_for_completion`` cancels the job
    when the waiting task is cancelled (or on Ctrl-C) and re-raises.
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

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return _raise_for(await self._http.request(method, path, **kwargs))
        except httpx.TransportError as exc:
            raise _unreachable(self.url, exc) from exc

    async def submit_job(self, op_name: str, task_desc: str, job_type: str = "single",
                         backend: str | None = None, arch: str | None = None,
                         dsl: str | None = None, framework: str = "torch",
                         workflow: str | None = None, **fields: Any) -> str:
        """See :meth:`AIKGClient.submit_job` (same keyword arguments)."""
        body = _submit_body(op_name, task_desc, {
            "job_type": job_type, "backend": backend, "arch": arch, "dsl": dsl,
            "framework": framework, "workflow": workflow, **fields})
        return (await self._request("POST", "/api/v1/jobs/submit", json=body)).json()["job_id"]

    async def get_job_status(self, job_id: str) -> dict[str, Any]:
        """See :meth:`AIKGClient.get_job_status`."""
        return (await self._request("GET", _path(job_id, "/status"))).json()

    async def get_queue_position(self, job_id: str) -> tuple[int | None, str | None]:
        """See :meth:`AIKGClient.get_queue_position`."""
        record = await self.get_job_status(job_id)
        return record.get("queue_position"), record.get("estimated_start_time")

    async def list_jobs(self, status: str | None = None, op_name: str | None = None,
                        limit: int = 50, offset: int = 0, tenant: str | None = None
                        ) -> dict[str, Any]:
        """See :meth:`AIKGClient.list_jobs`."""
        params = {k: v for k, v in (("status", status), ("op_name", op_name),
                                    ("tenant", tenant)) if v is not None}
        return (await self._request("GET", "/api/v1/jobs",
                                    params={**params, "limit": limit, "offset": offset})).json()

    async def cancel_job(self, job_id: str) -> dict[str, Any]:
        """See :meth:`AIKGClient.cancel_job`."""
        return (await self._request("POST", _path(job_id, "/cancel"))).json()

    async def get_kernel(self, job_id: str) -> str | None:
        """See :meth:`AIKGClient.get_kernel`."""
        try:
            return (await self._request("GET", _path(job_id, "/kernel"))).text
        except AIKGHTTPError as exc:
            if exc.status_code == 404 and "no kernel yet" in exc.detail:
                return None
            raise

    async def get_workers_status(self) -> dict[str, Any]:
        """See :meth:`AIKGClient.get_workers_status`."""
        return (await self._request("GET", "/api/v1/workers/status")).json()

    async def list_kernels(self, passed: bool | None = None, op_name: str | None = None,
                           backend: str | None = None, arch: str | None = None,
                           cursor: str | None = None, limit: int = 100) -> dict[str, Any]:
        """See :meth:`AIKGClient.list_kernels`."""
        return (await self._request("GET", "/api/v1/kernels", params=_kernel_params(
            passed, op_name, backend, arch, cursor, limit))).json()

    async def stream_events(self, job_id: str, last_event_id: int | None = None
                            ) -> AsyncIterator[dict[str, Any]]:
        """See :meth:`AIKGClient.stream_events`."""
        async for sse in self._sse(_path(job_id, "/events"), last_event_id):
            if sse.data:  # a keepalive comment decodes as an empty message
                yield _event(sse)

    async def _sse(self, path: str, last_event_id: int | None) -> AsyncIterator[Any]:
        """The server-sent events of ``path`` (resumed after ``last_event_id``).

        Raises:
            AIKGHTTPError: the gateway answered 4xx/5xx; AIKGConnectionError: unreachable.
        """
        headers = {"Last-Event-ID": str(last_event_id)} if last_event_id else {}
        timeout = httpx.Timeout(self._http.timeout.connect, read=_STREAM_READ_TIMEOUT_S)
        try:
            async with aconnect_sse(self._http, "GET", path, headers=headers,
                                    timeout=timeout) as source:
                if source.response.status_code >= 400:
                    await source.response.aread()
                    _raise_for(source.response)
                async for sse in source.aiter_sse():
                    yield sse
        except httpx.TransportError as exc:
            raise _unreachable(self.url, exc) from exc

    async def submit_batch(self, op_name: str, task_desc: str, candidates: list[str],
                           **fields: Any) -> dict[str, Any]:
        """See :meth:`AIKGClient.submit_batch` (same keyword arguments)."""
        return (await self._request("POST", "/api/v1/verify/batch", json=_batch_body(
            op_name, task_desc, candidates, fields))).json()

    async def get_batch(self, batch_id: str) -> dict[str, Any]:
        """See :meth:`AIKGClient.get_batch`."""
        return (await self._request("GET", _batch_path(batch_id))).json()

    async def cancel_batch(self, batch_id: str) -> dict[str, Any]:
        """See :meth:`AIKGClient.cancel_batch`."""
        return (await self._request("POST", _batch_path(batch_id, "/cancel"))).json()

    async def stream_batch_verdicts(self, batch_id: str, last_event_id: int | None = None
                                    ) -> AsyncIterator[dict[str, Any]]:
        """See :meth:`AIKGClient.stream_batch_verdicts` (keepalives are not yielded)."""
        async for sse in self._sse(_batch_path(batch_id, "/events"), last_event_id):
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
            with contextlib.suppress(AIKGError):
                await asyncio.shield(self.cancel_batch(batch_id))
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
            raise TimeoutError(f"batch {batch_id} did not end within {timeout:g} s; it goes "
                               "on (get_batch shows its verdicts)") from None
        except (KeyboardInterrupt, asyncio.CancelledError):
            with contextlib.suppress(AIKGError):
                await asyncio.shield(self.cancel_batch(batch_id))
            raise
        return _in_candidate_order(await self.get_batch(batch_id))

    async def wait_for_completion(self, job_id: str, timeout: float = 1800,
                                  poll_interval: float = 1.0, progress: bool = True, *,
                                  on_status: Any = None, cancel_on_interrupt: bool = True,
                                  unreachable_grace_s: float = 0.0) -> dict[str, Any]:
        """See :meth:`AIKGClient.wait_for_completion`; the job is also cancelled when the
        waiting task is (``cancel_on_interrupt``)."""
        try:
            with Progress(job_id, progress and sys.stderr.isatty()) as display:
                wait = JobWait(job_id, timeout, poll_interval, unreachable_grace_s,
                                [display.update, on_status], asyncio.get_running_loop().time)
                while True:
                    try:
                        if wait.ended(status := await self.get_job_status(job_id)):
                            return status
                    except AIKGConnectionError as exc:
                        wait.lost(exc)
                    await asyncio.sleep(wait.pause())
        except (KeyboardInterrupt, asyncio.CancelledError):
            if cancel_on_interrupt:
                with contextlib.suppress(AIKGError):
                    await asyncio.shield(self.cancel_job(job_id))
            raise


def _raise_for_stream(response: httpx.Response) -> None:
    if response.status_code >= 400:
        response.read()
        _raise_for(response)


def _verdict(sse: Any) -> dict[str, Any]:
    """A batch stream's message: the verdict with its ``number``; ``{}`` for a keepalive."""
    if not sse.data:
        return {}
    verdict = json.loads(sse.data)
    verdict["number"] = int(sse.id) if sse.id else None
    return verdict


def _event(sse: Any) -> dict[str, Any]:
    event = json.loads(sse.data)
    event["seq"] = int(sse.id) if sse.id else None
    return event
