"""structlog set-up: one JSON event per line on stderr, ids bound per job/request.

Bind ``job_id``, ``request_id``, ``candidate_id`` and ``worker_id`` with
``structlog.contextvars.bound_contextvars(...)`` so one job can be followed across
the three services by grepping its id.
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(service: str, level: str = "info", fmt: str = "json") -> None:
    """Route structlog (and stdlib logging) to stderr.

    Args:
        service: bound as ``service`` on every event (``gateway``, ``generator``, ``worker``).
        level: ``debug`` | ``info`` | ``warning`` | ``error``.
        fmt: ``json`` or ``console`` (human-readable, coloured when a TTY).
    """
    lvl = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    renderer = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service)
    logging.basicConfig(level=max(lvl, logging.WARNING), stream=sys.stderr)
