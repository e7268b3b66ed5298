"""Run the gateway under uvicorn.

uvloop where installed (the gateway is pure I/O: JSON, SSE and gRPC), structlog JSON lines for our
own logs and uvicorn's, access log only at debug level (one line per request is noise next to the
gateway's own per-completion line). SIGTERM/SIGINT are uvicorn's: it stops accepting, lets
in-flight requests finish for up to `graceful_shutdown_s`, then runs the app's shutdown, which
closes the core channel (cancelling any stream still open), and finally re-raises the signal, so the
process ends "killed by SIGTERM" as supervisors expect.
"""

from __future__ import annotations

import importlib.util
import logging

import uvicorn

from services.common.logging import configure_logging, get_logger
from services.common.tls import TlsFiles
from services.gateway.app import create_app

UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")


class _StructlogHandler(logging.Handler):
    """Re-emit uvicorn's stdlib log records through structlog, so every line is JSON."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            get_logger(record.name).log(record.levelno, record.getMessage())
        except Exception:  # noqa: BLE001 - a logging failure must never take the server down
            self.handleError(record)


def _route_uvicorn_logs_to_structlog(level: int) -> None:
    for name in UVICORN_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers = [_StructlogHandler()]
        logger.propagate = False
        logger.setLevel(level)


def event_loop_name() -> str:
    return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"


def run_gateway(
    host: str,
    port: int,
    core_target: str,
    log_level: str = "info",
    *,
    model_name_hint: str | None = None,
    graceful_shutdown_s: float = 30.0,
    core_tls: TlsFiles | None = None,
    api_keys: tuple[str, ...] = (),
    protect_metrics: bool = False,
) -> None:
    """Serve the OpenAI-compatible HTTP API on host:port until SIGTERM/SIGINT."""
    configure_logging("gateway", log_level)
    level = logging.getLevelName(log_level.upper())
    _route_uvicorn_logs_to_structlog(level)
    app = create_app(
        core_target,
        model_name_hint=model_name_hint,
        core_tls=core_tls,
        api_keys=api_keys,
        protect_metrics=protect_metrics,
    )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop=event_loop_name(),
        log_config=None,  # keep the handlers installed above
        log_level=level,
        access_log=log_level.lower() == "debug",
        timeout_graceful_shutdown=int(graceful_shutdown_s),
        server_header=False,
    )
    uvicorn.Server(config).run()
