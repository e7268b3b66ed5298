"""Run the gateway under uvicorn.

uvloop where installed (the gateway is pure I/O: JSON, SSE and gRPC), structlog JSON lines for our
own logs and uvicorn's, access log only at debug level (one line per request is noise next to the
gateway's own per-completion line), and the connection limits of http_limits.py. SIGTERM/SIGINT
are uvicorn's: it stops accepting, lets in-flight requests finish for up to `graceful_shutdown_s`,
then runs the app's shutdown, which closes the core channel (cancelling any stream still open), and
finally re-raises the signal, so the process ends "killed by SIGTERM" as supervisors expect.
"""

from __future__ import annotations

import importlib.util
import logging
import resource

import uvicorn

from services.common.logging import configure_logging, get_logger
from services.common.tls import TlsFiles
from services.gateway.app import create_app
from services.gateway.http_limits import guarded_protocol
from services.gateway.memory_bound import DEFAULT_MAX_CONNECTIONS, DEFAULT_REQUEST_MEMORY_MB

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


def uvicorn_config(app, max_connections: int = DEFAULT_MAX_CONNECTIONS, **options) -> uvicorn.Config:
    """uvicorn's settings for the gateway (also what the tests serve it with): uvloop where
    installed, httptools with the connection limits of http_limits.py, no server header."""
    return uvicorn.Config(
        app,
        loop=event_loop_name(),
        http=guarded_protocol(max_connections),
        log_config=None,  # keep the handlers installed by configure_logging
        server_header=False,
        **options,
    )


def raise_open_file_limit() -> None:
    """Every client connection holds a descriptor: raise the soft limit (often 256 on macOS, 1024
    on Linux) to the hard one, as vLLM's server does."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):  # macOS caps it below an unlimited hard limit
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(target, 10240), hard))


def run_gateway(
    host: str,
    port: int,
    core_target: str,
    log_level: str = "info",
    *,
    log_format: str = "auto",
    model_name_hint: str | None = None,
    graceful_shutdown_s: float = 30.0,
    core_tls: TlsFiles | None = None,
    api_keys: tuple[str, ...] = (),
    protect_metrics: bool = False,
    allowed_origins: tuple[str, ...] = (),
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    request_memory_mb: int = DEFAULT_REQUEST_MEMORY_MB,
    allow_image_urls: bool = False,
    allow_private_image_urls: bool = False,
) -> None:
    """Serve the OpenAI-compatible HTTP API on host:port until SIGTERM/SIGINT."""
    configure_logging("gateway", log_level, log_format)
    level = logging.getLevelName(log_level.upper())
    _route_uvicorn_logs_to_structlog(level)
    app = create_app(
        core_target,
        model_name_hint=model_name_hint,
        core_tls=core_tls,
        api_keys=api_keys,
        protect_metrics=protect_metrics,
        allowed_origins=allowed_origins,
        request_memory_mb=request_memory_mb,
        allow_image_urls=allow_image_urls,
        allow_private_image_urls=allow_private_image_urls,
    )
    raise_open_file_limit()
    config = uvicorn_config(
        app,
        max_connections=max_connections,
        host=host,
        port=port,
        log_level=level,
        access_log=log_level.lower() == "debug",
        timeout_graceful_shutdown=int(graceful_shutdown_s),
    )
    uvicorn.Server(config).run()
