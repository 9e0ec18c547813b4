"""structlog set-up: one JSON event per line on stderr, ids bound per job/request.

Bind ``job_id``, ``request_id``, ``candidate_id`` and ``worker_id`` with
``structlog.contextvars.bound_contextvars(...)`` so one job can be followed across
the three services by grepping its id. Every event also carries ``service`` (the
process's role), ``logger`` (the module's logger name, e.g. ``aikg.worker``),
``level`` and an ISO-8601 UTC ``timestamp``.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog


class _NamedPrintLogger(structlog.PrintLogger):
    """A PrintLogger that remembers the name it was created for (``get_logger(name)``)."""

    def __init__(self, file: TextIO | None = None, name: str = "") -> None:
        super().__init__(file)
        self.name = name


class _NamedPrintLoggerFactory:
    def __init__(self, file: TextIO | None) -> None:
        self._file = file

    def __call__(self, *args: Any) -> _NamedPrintLogger:
        # Resolve stderr at call time: pytest swaps sys.stderr per test.
        name = args[0] if args and isinstance(args[0], str) else ""
        return _NamedPrintLogger(self._file or sys.stderr, name)


def _add_logger_name(logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    name = getattr(logger, "name", "")
    if name:
        event_dict.setdefault("logger", name)
    return event_dict


def configure_logging(service: str, level: str = "info", fmt: str = "json",
                      stream: TextIO | None = None) -> None:
    """Route structlog (and stdlib logging) to ``stream``.

    Args:
        service: bound as ``service`` on every event (``gateway``, ``generator``, ``worker``).
        level: ``debug`` | ``info`` | ``warning`` | ``error``.
        fmt: ``json`` or ``console`` (human-readable, coloured when a TTY).
        stream: where events go, one per line; None means ``sys.stderr``.
    """
    lvl = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    out = stream or sys.stderr
    renderer = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=out.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            _add_logger_name,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=_NamedPrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service)
    logging.basicConfig(level=max(lvl, logging.WARNING), stream=out)
