"""Service routes: models, version, liveness, readiness, Prometheus metrics.

`/health` is liveness: 200 while the gateway runs, with core's grpc.health status alongside for
dashboards. `/ready` is readiness: 200 only when core answers SERVING (model loaded, every expert
reachable), else 503, so a load balancer sends traffic only where it can be served.
"""

from __future__ import annotations

from typing import Any

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from services.common.logging import get_logger
from services.common.version import moe_mesh_version
from services.gateway.core_client import CoreClient
from services.gateway.errors import OpenAIError, error_from_grpc
from services.gateway.metrics import CONTENT_TYPE_LATEST, GatewayMetrics
from services.gateway.served_model import served_model_name
from services.proto.moemesh.v1 import core_pb2

log = get_logger(__name__)
router = APIRouter()


async def _models(request: Request) -> list[core_pb2.ModelInfo]:
    core: CoreClient = request.app.state.core
    try:
        return await core.list_models(request.state.request_id)
    except grpc.aio.AioRpcError as error:
        raise error_from_grpc(error) from None


def _model_json(model: core_pb2.ModelInfo) -> dict[str, Any]:
    return {
        "id": model.id,
        "object": "model",
        "created": model.created or 0,
        "owned_by": "moe-mesh",
        "max_model_len": model.context_length or None,  # vLLM's name for the context length
    }


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model_json(model) for model in await _models(request)]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    for model in await _models(request):
        if model.id == model_id:
            return _model_json(model)
    raise OpenAIError(404, f"model {model_id!r} does not exist", param="model", code="model_not_found")


@router.get("/version")
async def version() -> dict[str, str]:
    """moe-mesh's version, in vLLM's shape."""
    return {"version": moe_mesh_version()}


@router.get("/health")
async def health(request: Request) -> dict[str, str]:
    core: CoreClient = request.app.state.core
    return {"status": "ok", "core": await core.health()}


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    core: CoreClient = request.app.state.core
    status = await core.health()
    if status != "SERVING":
        raise OpenAIError(503, f"core is not ready (health: {status})", code="core_not_ready")
    return JSONResponse({"status": "ready", "core": status})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    registry: GatewayMetrics = request.app.state.metrics
    core: CoreClient = request.app.state.core
    try:
        stats = await core.stats(request.state.request_id)
    except grpc.aio.AioRpcError as error:  # scrape anyway: the gateway's own series are still true
        log.debug("core stats unavailable for /metrics", grpc_code=error.code().name)
    else:
        registry.set_core_gauges(await served_model_name(request), stats)
    return Response(registry.exposition(), media_type=CONTENT_TYPE_LATEST)
