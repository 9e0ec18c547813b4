"""The gateway API's request-answer calls, each written once and without I/O; the
blocking and the asyncio client (:mod:`services.sdk.client`) run them over httpx.

A call is a generator: it yields the :class:`Request` to send, is sent back the
``httpx.Response`` (or has the client's error thrown in at the ``yield``: an
:class:`AIKGHTTPError` for a 4xx/5xx answer, an :class:`AIKGConnectionError` when
the gateway cannot be reached) and returns what the caller gets. :func:`run_blocking`
and :func:`run_async` drive one; :func:`blocking` and :func:`awaitable` make the
clients' methods of a call, with its signature and docstring.

The calls take the client as ``self`` (unused: a call needs nothing but its
arguments), so that a client's method is the call itself to ``inspect`` and ``help``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Awaitable, Callable, Generator
from typing import Any, TypeVar
from urllib.parse import quote

import httpx

from services.sdk.errors import AIKGError, AIKGHTTPError

T = TypeVar("T")
# A call: yields requests, is sent their responses, returns its result.
Call = Generator["Request", httpx.Response, T]


@dataclasses.dataclass(frozen=True)
class Request:
    """One HTTP request of a call, relative to the gateway's base URL."""

    method: str
    path: str
    params: dict[str, Any] | None = None
    json: Any = None


def run_blocking(send: Callable[[Request], httpx.Response], call: Call[T]) -> T:
    """Drive ``call``, sending each request with ``send``; the client's errors
    (:class:`AIKGError`) are thrown into the call, which may handle them."""
    try:
        request = next(call)
        while True:
            try:
                response = send(request)
            except AIKGError as exc:
                request = call.throw(exc)
            else:
                request = call.send(response)
    except StopIteration as stop:
        return stop.value


async def run_async(send: Callable[[Request], Awaitable[httpx.Response]], call: Call[T]) -> T:
    """:func:`run_blocking` with an awaitable ``send``."""
    try:
        request = next(call)
        while True:
            try:
                response = await send(request)
            except AIKGError as exc:
                request = call.throw(exc)
            else:
                request = call.send(response)
    except StopIteration as stop:
        return stop.value


def blocking(call: Callable[..., Call[Any]]) -> Callable[..., Any]:
    """The blocking client's method of ``call`` (the client has ``_send``)."""
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return run_blocking(self._send, call(self, *args, **kwargs))
    return _like(method, call)


def awaitable(call: Callable[..., Call[Any]]) -> Callable[..., Any]:
    """The asyncio client's method of ``call`` (a coroutine; the client has an async
    ``_send``)."""
    async def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return await run_async(self._send, call(self, *args, **kwargs))
    return _like(method, call)


def _like(method: Callable[..., Any], call: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` with ``call``'s name, docstring and signature, returning what the
    call returns (``Call[T]`` -> ``T``)."""
    functools.update_wrapper(method, call)
    signature = inspect.signature(call)
    returns = str(signature.return_annotation)
    if returns.startswith("Call[") and returns.endswith("]"):
        method.__signature__ = signature.replace(  # type: ignore[attr-defined]
            return_annotation=returns[len("Call["):-1])
    return method


def raise_for(response: httpx.Response) -> httpx.Response:
    """``response`` when it is not an error; else :class:`AIKGHTTPError` with the
    gateway's ``detail`` (or the body's text) and the JSON body."""
    if response.status_code < 400:
        return response
    try:
        body = response.json()
    except ValueError:
        body = None
    detail = body.get("detail") if isinstance(body, dict) else None
    raise AIKGHTTPError(response.status_code,
                        str(detail or response.text.strip() or response.reason_phrase), body)


def job_path(job_id: str, suffix: str = "") -> str:
    return f"/api/v1/jobs/{quote(job_id, safe='')}{suffix}"


def batch_path(batch_id: str, suffix: str = "") -> str:
    return f"/api/v1/verify/batch/{quote(batch_id, safe='')}{suffix}"


def in_candidate_order(record: dict[str, Any]) -> list[dict[str, Any] | None]:
    """A batch record's verdicts by candidate index (None: a candidate without one,
    e.g. cancelled before it started)."""
    verdicts: list[dict[str, Any] | None] = [None] * len(record["candidates"])
    for verdict in record["verdicts"]:
        verdicts[verdict["index"]] = verdict
    return verdicts


def _given(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


class Calls:
    """Every request-answer call of the gateway API (the clients' methods of the same
    names; their streams and waits are the clients' own)."""

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
    ) -> Call[str]:
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
        answer = yield from Calls.submit(
            self, op_name, task_desc, job_type=job_type, backend=backend, arch=arch, dsl=dsl,
            framework=framework, workflow=workflow, max_rounds=max_rounds,
            parallel_num=parallel_num, num_islands=num_islands,
            migration_interval=migration_interval, elite_size=elite_size,
            parent_selection_prob=parent_selection_prob, init_code=init_code,
            shape_overrides=shape_overrides, coder=coder, job_id=job_id, priority=priority,
            **fields)
        return answer["job_id"]

    def submit(self, op_name: str, task_desc: str, **fields: Any) -> Call[dict[str, Any]]:
        """Submit a job; returns the gateway's whole answer: ``job_id``, ``status``,
        ``backend``, ``arch`` (the one it routed to, or None) and ``message``.

        ``fields`` are JobSubmit wire fields; None leaves one to the gateway's default.

        Raises:
            AIKGHTTPError, AIKGConnectionError: as :meth:`submit_job`.
        """
        body = {"op_name": op_name, "task_desc": task_desc, **_given(fields)}
        return (yield Request("POST", "/api/v1/jobs/submit", json=body)).json()

    def get_job_status(self, job_id: str) -> Call[dict[str, Any]]:
        """The job record: ``status``, ``job_type``, ``op_name``, ``submit_time``,
        ``result`` (``code``, ``verdict``), ``error``, ``progress``, ``tenant``,
        ``priority``; while it waits, ``queue_position`` (1: next) and
        ``estimated_start_time`` (RFC 3339, or None without a recent throughput).

        Raises:
            AIKGHTTPError: 404 for an unknown job.
        """
        return (yield Request("GET", job_path(job_id, "/status"))).json()

    def get_queue_position(self, job_id: str) -> Call[tuple[int | None, str | None]]:
        """``(queue_position, estimated_start_time)`` of a waiting job; ``(None, None)``
        once it has started (or when the gateway cannot tell).

        Raises:
            AIKGHTTPError: 404 for an unknown job.
        """
        record = yield from Calls.get_job_status(self, job_id)
        return record.get("queue_position"), record.get("estimated_start_time")

    def list_jobs(self, status: str | None = None, op_name: str | None = None,
                  limit: int = 50, offset: int = 0, tenant: str | None = None
                  ) -> Call[dict[str, Any]]:
        """Job summaries, newest first: ``{"jobs": [...], "total", "limit", "offset"}``;
        waiting jobs carry ``queue_position`` and ``estimated_start_time``."""
        params = {**_given({"status": status, "op_name": op_name, "tenant": tenant}),
                  "limit": limit, "offset": offset}
        return (yield Request("GET", "/api/v1/jobs", params=params)).json()

    def cancel_job(self, job_id: str) -> Call[dict[str, Any]]:
        """Cancel the job; returns its record (unchanged when it had already ended)."""
        return (yield Request("POST", job_path(job_id, "/cancel"))).json()

    def get_kernel(self, job_id: str) -> Call[str | None]:
        """The job's kernel source, or None while it has none."""
        try:
            return (yield Request("GET", job_path(job_id, "/kernel"))).text
        except AIKGHTTPError as exc:
            if exc.status_code == 404 and "no kernel yet" in exc.detail:
                return None
            raise

    def get_workers_status(self) -> Call[dict[str, Any]]:
        """Live workers: ``{"workers": [{backend, arch, devices, capacity, in_flight,
        load, leases, ...}]}``."""
        return (yield Request("GET", "/api/v1/workers/status")).json()

    def list_kernels(self, passed: bool | None = None, op_name: str | None = None,
                     backend: str | None = None, arch: str | None = None,
                     cursor: str | None = None, limit: int = 100) -> Call[dict[str, Any]]:
        """One page of kernels (``GET /api/v1/kernels``): ``{"kernels": [KernelRow
        dicts], "next_cursor": str, "more": bool}``, ordered by the job's end time.

        Args:
            passed: only kernels that passed (True) or failed (False); None: both.
            cursor: the ``next_cursor`` of an earlier page (None: from the first).
            limit: rows per page, 1 to 500.

        Raises:
            AIKGHTTPError: 400 for a cursor the gateway did not send or a bad limit.
        """
        params: dict[str, Any] = {"limit": limit}
        if passed is not None:
            params["passed"] = "true" if passed else "false"
        params.update(_given({"op_name": op_name, "backend": backend, "arch": arch,
                              "cursor": cursor}))
        return (yield Request("GET", "/api/v1/kernels", params=params)).json()

    def submit_batch(self, op_name: str, task_desc: str, candidates: list[str], *,
                     backend: str | None = None, arch: str | None = None,
                     shape_overrides: dict[str, Any] | None = None, trials: int | None = None,
                     timeout_s: float | None = None, priority: str | None = None,
                     batch_id: str | None = None, **fields: Any) -> Call[dict[str, Any]]:
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
        body = {"op_name": op_name, "task_desc": task_desc, "candidates": list(candidates),
                **_given({"backend": backend, "arch": arch, "shape_overrides": shape_overrides,
                          "trials": trials, "timeout_s": timeout_s, "priority": priority,
                          "batch_id": batch_id, **fields})}
        return (yield Request("POST", "/api/v1/verify/batch", json=body)).json()

    def get_batch(self, batch_id: str) -> Call[dict[str, Any]]:
        """The batch's record: ``status``, ``task``, ``candidates`` and ``verdicts`` (in
        the order they finished).

        Raises:
            AIKGHTTPError: 404 for an unknown batch (or another tenant's).
        """
        return (yield Request("GET", batch_path(batch_id))).json()

    def cancel_batch(self, batch_id: str) -> Call[dict[str, Any]]:
        """Cancel the batch: what no worker has started is not verified; returns the
        record."""
        return (yield Request("POST", batch_path(batch_id, "/cancel"))).json()
