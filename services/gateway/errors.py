"""The gateway's error answers: one JSON shape, and the exception handlers that give it.

Every error is ``{"status_code": ..., "detail": "<what was wrong and what to do>", ...}``;
extra keys (``live``, ``errors``, ``tenant``, ``limit``, ``job_id``, ``fault``) add what
a client needs to act on it. The handlers are registered on the app by exception class
(Litestar's ``exception_handlers``, https://docs.litestar.dev/2/usage/exceptions.html):

- :func:`nats_unavailable_response` for :data:`NATS_TROUBLE` and :class:`NatsUnavailable`:
  503 with ``Retry-After``, whichever route met it, so routes do not catch them;
- :func:`error_response` for everything else (HTTP errors keep their status, a corrupt
  job record is 500 naming the job, anything unexpected is 500 and logged).
"""

from __future__ import annotations

from typing import Any

import nats.errors
import nats.js.errors
import structlog
from litestar import Request, Response
from litestar.exceptions import HTTPException, NotFoundException, ValidationException

from schemas import MAX_SOURCE_BYTES, subjects
from services.common.jobs import JobRecordCorrupt

log = structlog.get_logger("aikg.gateway")

# Tasks are at most 1 MiB (schemas.MAX_SOURCE_BYTES); a body holds a task and
# optionally an init_code of the same bound, plus JSON escaping: 2 MiB covers real
# submissions and refuses anything larger with 413 before it is read.
REQUEST_MAX_BODY_BYTES = 2 << 20

# Seconds a client is told to wait (``Retry-After``) before retrying a 503 for NATS.
NATS_RETRY_AFTER_S = 2

# NATS failures a request can meet (server gone, reconnecting, slow), and JetStream's
# answers while a stream or consumer has no leader (a cluster node failing over): the
# client's retry will likely succeed, so they are answered 503, not 500.
NATS_TROUBLE: tuple[type[Exception], ...] = (
    nats.errors.TimeoutError, nats.errors.ConnectionClosedError, nats.errors.NoRespondersError,
    nats.errors.StaleConnectionError, TimeoutError,
    nats.js.errors.NoStreamResponseError, nats.js.errors.ServiceUnavailableError,
)


class NatsUnavailable(Exception):
    """The gateway has no usable NATS connection (not connected yet, or reconnecting).

    Raised by the ``bus`` dependency (services/gateway/deps.py) before a route starts,
    rather than letting the route wait out a request timeout; answered 503 by
    :func:`nats_unavailable_response` with ``str(exc)`` as the detail.
    """


def unknown_job(job_id: str) -> NotFoundException:
    """404 for a job id that has no record (or that no job can have)."""
    return NotFoundException(
        detail=f"no job with id {job_id!r}: it was never submitted here, or its record was "
        "removed (job ids are letters, digits, '_' and '-'; `GET /api/v1/jobs` lists them)"
    )


def nats_unavailable_response(request: Request, exc: Exception) -> Response[dict[str, Any]]:
    """503 with ``Retry-After`` for NATS trouble met anywhere in a route.

    The body: ``{"status_code": 503, "detail": "<what failed>; retry shortly"}``; for
    :class:`NatsUnavailable` the detail is its message, for the others it names the
    exception and the route (``GET /api/v1/jobs``), since the client cannot see which
    NATS call of the route failed.
    """
    if isinstance(exc, NatsUnavailable):
        detail = str(exc)
    else:
        log.warning("nats_unavailable", path=request.url.path, error=exc.__class__.__name__)
        detail = (f"cannot answer {request.method} {request.url.path}: NATS did not answer in "
                  f"time ({exc.__class__.__name__}; a cluster node may be failing over); "
                  "retry shortly")
    return Response({"status_code": 503, "detail": detail}, status_code=503,
                    headers={"Retry-After": str(NATS_RETRY_AFTER_S)})


def _validation_detail(exc: ValidationException) -> str:
    """msgspec's own wording for a body error: ``Expected `int` >= 1 - at `$.max_rounds```."""
    parts = []
    for err in exc.extra if isinstance(exc.extra, list) else []:
        message = err.get("message", "") if isinstance(err, dict) else str(err)
        key = err.get("key") if isinstance(err, dict) else None
        if key and key != "data":
            message += f" - at `$.{key}`"
        parts.append(message)
    return "invalid request: " + ("; ".join(parts) if parts else exc.detail)


def _corrupt_record_response(exc: JobRecordCorrupt) -> Response[dict[str, Any]]:
    """500 for a job whose record in the ``jobs`` bucket does not decode.

    The body names the job and the decoder's fault: ``{"status_code": 500, "detail":
    "job record <id> is corrupt: <fault>; ...", "job_id": ..., "fault": ...}``.

    Why 500: the fault is in the state the service keeps, not in the request. A 4xx
    (409, 422) would tell the client that another request could succeed, and none can;
    a 503 would invite retries that meet the same bytes. What helps is an operator
    removing or restoring the record, which the detail says how to do; a generator
    that picks the job up replaces the record with a ``failed`` one naming the fault.
    """
    log.warning("job_record_corrupt", job_id=exc.job_id, fault=exc.fault)
    detail = (f"{exc}; the stored record cannot be read, so the job's state is unknown. "
              f"An operator can remove it with `nats kv del {subjects.BUCKET_JOBS} "
              f"{exc.job_id}`; a generator running the job fails it with this reason")
    return Response({"status_code": 500, "detail": detail, "job_id": exc.job_id,
                     "fault": exc.fault}, status_code=500)


def error_response(request: Request, exc: Exception) -> Response[dict[str, Any]]:
    """One JSON error shape for every other error: status_code, detail, extra keys."""
    if isinstance(exc, JobRecordCorrupt):
        return _corrupt_record_response(exc)
    if isinstance(exc, ValidationException):
        body: dict[str, Any] = {"status_code": 400, "detail": _validation_detail(exc)}
        if exc.extra:
            body["errors"] = exc.extra
        return Response(body, status_code=400)
    if isinstance(exc, HTTPException):
        detail = exc.detail
        if exc.status_code == 413:
            detail = (f"request body is over {REQUEST_MAX_BODY_BYTES} bytes; a task_desc may "
                      f"be at most {MAX_SOURCE_BYTES} bytes")
        body = {"status_code": exc.status_code, "detail": detail}
        if isinstance(exc.extra, dict):
            body.update(exc.extra)
        elif exc.extra:
            body["errors"] = exc.extra
        return Response(body, status_code=exc.status_code, headers=exc.headers)
    log.exception("unhandled_error", path=request.url.path)
    return Response({"status_code": 500, "detail": f"internal error: {exc.__class__.__name__}"},
                    status_code=500)


# Litestar picks a handler by the first class in the exception's MRO that has one.
EXCEPTION_HANDLERS: dict[type[Exception], Any] = {
    Exception: error_response,
    NatsUnavailable: nats_unavailable_response,
    **{cls: nats_unavailable_response for cls in NATS_TROUBLE},
}
