"""The gateway's FastAPI app: OpenAI and Anthropic HTTP in front of core's gRPC `Generate` stream.

Routes: `POST /v1/chat/completions`, `POST /v1/completions` (routes_openai); `POST /v1/messages`,
`POST /v1/messages/count_tokens` (routes_anthropic); `GET /v1/models`, `GET /v1/models/{id}`,
`/version`, `/health`, `/ready`, `/metrics` (routes_service); `/status`, `/status.json` (the
operator's page, routes_status); `POST /tokenize`, `/detokenize` (routes_tokenize);
`GET /openapi.json`. Middleware, outermost first: request id (every response carries
X-Request-Id, every log line the request id), optional API keys, body size cap and the budget
of request bodies in flight (memory_bound.py).
The gateway holds no state besides the gRPC channel, the metrics and the served model's name: any
number of them can front one core.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from services.common.images import DEFAULT_MAX_IMAGE_BYTES
from services.common.logging import get_logger
from services.common.tls import TlsFiles
from services.common.version import moe_mesh_version
from services.gateway import routes_anthropic, routes_openai, routes_service, routes_status, routes_tokenize
from services.gateway.auth import ApiKeyMiddleware
from services.gateway.core_client import CoreClient, CoreClientConfig
from services.gateway.errors import install_error_handlers
from services.gateway.image_parts import ImageLoader
from services.gateway.memory_bound import DEFAULT_REQUEST_MEMORY_MB, MIB, RequestMemoryBudget
from services.gateway.metrics import GatewayMetrics
from services.gateway.middleware import BodySizeLimitMiddleware, RequestIdMiddleware
from services.gateway.status_view import ThroughputHistory

log = get_logger(__name__)


def create_app(
    core_target: str,
    *,
    model_name_hint: str | None = None,
    generate_timeout_s: float = 600.0,
    unary_timeout_s: float = 5.0,
    max_body_bytes: int = 32 * 1024 * 1024,
    api_keys: Iterable[str] = (),
    core_tls: TlsFiles | None = None,
    protect_metrics: bool = False,
    allowed_origins: Iterable[str] = (),
    request_memory_mb: int = DEFAULT_REQUEST_MEMORY_MB,
    allow_image_urls: bool = False,
    allow_private_image_urls: bool = False,
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
) -> FastAPI:
    """Build the app; the core channel opens at startup (inside uvicorn's loop) and closes at shutdown.
    `allow_image_urls`: fetch http(s) image URLs in chats (else only inline images are taken), from
    public addresses only unless `allow_private_image_urls`; `allowed_origins`: browser origins
    that may call it (CORS; `*` for any), none by default."""
    config = CoreClientConfig(
        core_target, generate_timeout_s=generate_timeout_s, unary_timeout_s=unary_timeout_s, tls=core_tls
    )
    keys = tuple(api_keys)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.core = CoreClient(config)
        log.info("gateway started", core_target=core_target, api_keys=len(keys))
        try:
            async with routes_status.throughput_sampler(app):
                yield
        finally:
            await app.state.core.close()

    app = FastAPI(
        title="moe-mesh gateway",
        version=moe_mesh_version(),
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
    )
    app.state.model_name_hint = model_name_hint
    app.state.served_model = None
    app.state.metrics = GatewayMetrics()
    app.state.throughput = ThroughputHistory()
    install_error_handlers(app)
    app.state.request_memory = RequestMemoryBudget(request_memory_mb * MIB)
    app.state.images = ImageLoader(
        allow_urls=allow_image_urls,
        allow_private_urls=allow_private_image_urls,
        max_bytes=max_image_bytes,
        budget=app.state.request_memory,
    )
    app.add_middleware(
        BodySizeLimitMiddleware, max_body_bytes=max_body_bytes, budget=app.state.request_memory
    )
    app.add_middleware(ApiKeyMiddleware, keys=keys, protect_metrics=protect_metrics)
    app.add_middleware(RequestIdMiddleware)  # outermost but CORS: sees every response
    if allowed_origins := list(allowed_origins):
        # Outside the key check: a browser's preflight carries no key, and every answer (a 401
        # too) must carry the headers that let the page read it.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=allowed_origins,
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
            expose_headers=["x-request-id"],
            max_age=600,
        )
    for module in (routes_openai, routes_anthropic, routes_service, routes_status, routes_tokenize):
        app.include_router(module.router)
    return app
