"""The errors of the gateway clients (:mod:`services.sdk.client`): one base class, one
for a gateway that cannot be reached, one for a request it refused."""

from __future__ import annotations

from typing import Any


class AIKGError(Exception):
    """Base of the errors this client raises."""


class AIKGConnectionError(AIKGError):
    """The gateway could not be reached (refused, DNS, timeout).

    Attributes:
        url: the gateway's base URL.
        reason: what the transport said (``"[Errno 111] Connection refused"``).
    """

    def __init__(self, message: str, url: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.url = url
        self.reason = reason


class AIKGHTTPError(AIKGError):
    """The gateway answered with an error status.

    Attributes:
        status_code: HTTP status (400 bad body, 401 token, 404 unknown job, 409 no live
            worker for backend/arch, 413 too large, 503 NATS unavailable).
        detail: the gateway's explanation of what was wrong and what to do.
        body: the whole JSON error body (``live`` lists live backend/arch pairs on 409).
    """

    def __init__(self, status_code: int, detail: str, body: Any = None) -> None:
        super().__init__(f"gateway answered {status_code}: {detail}")
        self.status_code = status_code
        self.detail = detail
        self.body = body
