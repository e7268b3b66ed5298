"""structlog logging shared by every service: readable on a terminal, JSON for machines.

`--log-format auto` (the default) renders with structlog's console renderer when stderr is a
terminal and as one JSON object per line otherwise (a log file, a pipe, launchd, journald).
Each line carries the service name; a request id bound with
`structlog.contextvars.bind_contextvars(request_id=...)` appears in every line the
request causes, and travels between services in the `x-request-id` gRPC metadata key.
"""

from __future__ import annotations

import logging
import sys

import structlog

REQUEST_ID_METADATA_KEY = "x-request-id"


LOG_FORMATS = ("auto", "console", "json")


class CurrentStderr:
    """Writes to `sys.stderr` as it is at each write, not as it was when logging was configured:
    a caller that swaps stderr (a test's capture, an embedding host) and closes the old one
    leaves every logger writing on, including those cached on first use."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def renders_console(log_format: str) -> bool:
    """Whether `log_format` means structlog's console renderer here (else JSON lines)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, not {log_format!r}")
    return log_format == "console" or (log_format == "auto" and sys.stderr.isatty())


def configure_logging(service: str, level: str = "info", log_format: str = "auto") -> None:
    console = renders_console(log_format)
    renderer = (
        structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
        if console
        else structlog.processors.JSONRenderer()
    )
    logging.basicConfig(format="%(message)s", stream=CurrentStderr(), level=level.upper())

    def add_service(_, __, event: dict) -> dict:
        # A processor, not a contextvar: threads (the engine) start with empty contexts.
        event.setdefault("service", service)
        return event

    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            add_service,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            *([] if console else [structlog.processors.format_exc_info]),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=CurrentStderr()),
        cache_logger_on_first_use=True,
    )


def get_logger(name: str | None = None):
    return structlog.get_logger(name)
