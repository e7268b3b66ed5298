"""structlog JSON logging shared by every service.

Each line carries the service name; a request id bound with
`structlog.contextvars.bind_contextvars(request_id=...)` appears in every line the
request causes, and travels between services in the `x-request-id` gRPC metadata key.
"""

from __future__ import annotations

import logging
import sys

import structlog

REQUEST_ID_METADATA_KEY = "x-request-id"


def configure_logging(service: str, level: str = "info") -> None:
    logging.basicConfig(format="%(message)s", stream=sys.stderr, level=level.upper())

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
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def get_logger(name: str | None = None):
    return structlog.get_logger(name)
