"""What the gateway takes from a request before any step of a route: the body decoded
with msgspec's strict rules and its nesting bounded, the task's static check, and the
``Last-Event-ID`` an event stream resumes after. Shared by the jobs' and the batches'
routes (services/gateway/jobs.py, services/gateway/batches.py); a fault is answered 400
naming the field.
"""

from __future__ import annotations

import contextlib
import re
from typing import TypeVar

import msgspec
import numpy as np
from litestar import Request
from litestar.exceptions import ClientException, ValidationException

from schemas import JobSubmit, decode
from schemas.events import ShapeValue
from services.common import task_source

T = TypeVar("T")

# msgspec's error text ends with the field's path: "... - at `$.max_rounds`".
_FIELD_PATH_RE = re.compile(r"^(?P<message>.*) - at `\$\.?(?P<key>[^`]*)`$", re.DOTALL)

# Deepest nesting of arrays and objects a submission may have: a JobSubmit is at most
# three deep (body, shape_overrides, a shape list); 32 leaves room for clients that wrap
# and is far below the depth at which decoding would exhaust Python's stack.
MAX_JSON_DEPTH = 32
# A JSON string literal (escapes included), written as an unrolled loop so that a long
# string is matched at C speed.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_BRACKET_STEP = np.zeros(256, dtype=np.int8)
_BRACKET_STEP[[ord("["), ord("{")]] = 1
_BRACKET_STEP[[ord("]"), ord("}")]] = -1


def json_depth(body: bytes) -> int:
    """Deepest nesting of ``[``/``{`` in a JSON text, brackets inside strings not
    counted; found without decoding it (a decoder recurses once per level). Linear
    time at C speed (a regular expression, then a running sum in numpy): a 2 MiB body
    takes milliseconds."""
    steps = _BRACKET_STEP[np.frombuffer(_JSON_STRING.sub(b'""', body), dtype=np.uint8)]
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0))


async def check_submit_body(request: Request) -> None:
    """``before_request`` of the submit route, so that it runs before Litestar decodes
    the body its own (lax) way: 400 when the body nests deeper than
    :data:`MAX_JSON_DEPTH` (a decoder would fail with ``RecursionError``), then the
    strict decode (:func:`_strict_submit`), kept in ``request.state.submit``. The
    body's size is bounded by the app (``REQUEST_MAX_BODY_BYTES``, 413).

    Raises:
        ValidationException: answered 400, naming the field at fault.
    """
    refuse_deep_body(await request.body())
    request.state.submit = await _strict_submit(request)
    # Which fields the body gave (top level only, values left undecoded): a default
    # the tenant's limits do not allow is lowered, an explicit value refused.
    request.state.given = set(msgspec.json.decode(await request.body(),
                                                  type=dict[str, msgspec.Raw]))


def refuse_deep_body(body: bytes) -> None:
    """400 when ``body`` nests arrays/objects deeper than :data:`MAX_JSON_DEPTH` (a
    decoder would fail with ``RecursionError``).

    Raises:
        ValidationException: answered 400.
    """
    depth = json_depth(body)
    if depth > MAX_JSON_DEPTH:
        detail = (f"request body nests arrays/objects {depth} levels deep; at most "
                  f"{MAX_JSON_DEPTH} are accepted")
        raise ValidationException(detail=detail, extra=[
            {"message": detail, "key": "data", "source": "body"}])


def _name_shape_entry(body: bytes, text: str) -> str:
    """msgspec's error text with ``shape_overrides[...]`` (its path for a dict value)
    replaced by the entry at fault, e.g. ``shape_overrides.batch_size`` or
    ``shape_overrides.dim[1]``."""
    if "at `$.shape_overrides[...]" not in text:
        return text
    with contextlib.suppress(Exception):
        overrides = msgspec.json.decode(body).get("shape_overrides") or {}
        for name, value in overrides.items():
            try:
                msgspec.convert(value, ShapeValue, strict=True)
            except msgspec.ValidationError as exc:
                message, _, inner = str(exc).partition(" - at `$")
                return f"{message} - at `$.shape_overrides.{name}{inner.rstrip('`')}`"
    return text


async def _strict_submit(request: Request) -> JobSubmit:
    """The body decoded as :class:`JobSubmit` with msgspec's strict rules.

    Litestar converts bodies in msgspec's lax mode (``strict=False``), which turns
    ``"max_rounds": "3"`` into 3; a raw ``nats pub`` on ``jobs.submit`` is decoded
    strictly by the generator (:func:`schemas.decode`), so the HTTP door applies the
    same rule: a number in a string, a float for an integer field or a string for a
    boolean is refused (an integer for a float field is accepted). See msgspec's
    "Strict vs Lax Mode" (https://jcristharif.com/msgspec/usage.html#strict-vs-lax-mode).

    Raises:
        ValidationException: answered 400, the message naming the field
            (``Expected `int`, got `str` - at `$.max_rounds```).
    """
    return strict_decode(await request.body(), JobSubmit)


def strict_decode(body: bytes, record_type: type[T]) -> T:
    """``body`` decoded as ``record_type`` with msgspec's strict rules (as
    :func:`_strict_submit` explains), for every body the gateway takes.

    Raises:
        ValidationException: answered 400, the message naming the field
            (``Expected `str`, got `int` - at `$.candidates[3]```).
    """
    try:
        return decode(body, record_type)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        text = _name_shape_entry(body, str(exc))
        match = _FIELD_PATH_RE.match(text)
        error = ({"message": match["message"], "key": match["key"] or "data", "source": "body"}
                 if match else {"message": text, "key": "data", "source": "body"})
        raise ValidationException(detail=text, extra=[error]) from exc


def check_task(task_desc: str, shape_overrides: dict[str, object] | None = None) -> None:
    """400 unless ``task_desc`` is a KernelBench-format task (static check, no run) and
    every ``shape_overrides`` name is one the task assigns at top level (the check
    ``aikg run --shape`` makes; :mod:`services.common.task_source`)."""
    try:
        task_source.check_task(task_desc, shape_overrides)
    except task_source.TaskError as exc:
        if exc.field != "shape_overrides":
            raise ClientException(detail=str(exc)) from exc
        raise ValidationException(detail=str(exc), extra=[
            {"message": str(exc), "key": "shape_overrides", "source": "body"}]) from exc


# The largest Last-Event-ID an event stream resumes after: the next id must still be
# a JetStream sequence, which nats-server keeps as an unsigned 64-bit integer (and
# parses as one from a consumer's ``opt_start_seq``); kept within int64 for clients.
MAX_EVENT_ID = 2**63 - 2


def resume_after(last_event_id: str | None, what: str) -> int:
    """The ``Last-Event-ID`` an event stream resumes after (0: from the start).

    Raises:
        ClientException: a 400 naming ``what`` the id must be (``an event id``) when it
            is not a whole number in ASCII digits from 0 to :data:`MAX_EVENT_ID`
            (negative, too large, a sign, spaces, ``_`` or other digits).
    """
    if not last_event_id:
        return 0
    text = last_event_id.strip()
    if not (text.isascii() and text.isdigit()):
        if text.startswith("-") and text[1:].isascii() and text[1:].isdigit():
            raise ClientException(detail="Last-Event-ID must not be negative")
        raise ClientException(detail=f"Last-Event-ID must be {what} (an integer) sent by "
                              f"this route, not {last_event_id[:40]!r}")
    if len(text) > len(str(MAX_EVENT_ID)) or int(text) > MAX_EVENT_ID:
        raise ClientException(detail=f"Last-Event-ID {text[:40]}{'...' if len(text) > 40 else ''}"
                              f" is out of range: {what} sent by this route is at most "
                              f"{MAX_EVENT_ID}")
    return int(text)
