"""Service routes: models, version, liveness, readiness, Prometheus metrics.

`/health` is liveness only: 200 while the gateway runs, with core's grpc.health status alongside
for dashboards. `/ready` is readiness: 200 only when core answers SERVING (model loaded, every
expert of every layer owned by a reachable worker), else 503 naming why, so a load balancer sends
traffic only where it can be served.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from services.common.logging import get_logger
from services.common.version import moe_mesh_version
from services.gateway.core_client import CoreClient
from services.gateway.errors import OpenAIError, error_from_grpc
from services.gateway.metrics import CONTENT_TYPE_LATEST, GatewayMetrics
from services.gateway.metrics_relay import relayed_exposition
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
    """One model as OpenAI lists it, with the fields Anthropic's clients read beside them."""
    created = model.created or 0
    return {
        "id": model.id,
        "object": "model",
        "created": created,
        "owned_by": "moe-mesh",
        "max_model_len": model.context_length or None,  # vLLM's name for the context length
        "type": "model",
        "display_name": model.id,
        "created_at": datetime.fromtimestamp(created, UTC).isoformat().replace("+00:00", "Z"),
    }


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    data = [_model_json(model) for model in await _models(request)]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    # OpenAI's list, and Anthropic's page fields (one page holds every model)
    return {"object": "list", "data": data, "has_more": False, "first_id": first, "last_id": last}


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
@router.head("/health", include_in_schema=False)  # uptime checkers send HEAD
async def health(request: Request) -> dict[str, str]:
    core: CoreClient = request.app.state.core
    return {"status": "ok", "core": await core.health()}


@router.get("/ready")
@router.head("/ready", include_in_schema=False)
async def ready(request: Request) -> JSONResponse:
    core: CoreClient = request.app.state.core
    status = await core.health()
    if status != "SERVING":
        reason = f"health: {status}"
        if status == "NOT_SERVING":  # core answers: ask it why (a missing worker, the model loading)
            try:
                reason = "; ".join((await core.stats(request.state.request_id)).problems) or reason
            except grpc.aio.AioRpcError:
                pass
        raise OpenAIError(503, f"core is not ready: {reason}", code="core_not_ready")
    return JSONResponse({"status": "ready", "core": status})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """The gateway's series, core's gauges under vLLM's names, and (relayed through core, labelled
    by `service` and `worker`) core's and every worker's own series: one scrape target."""
    registry: GatewayMetrics = request.app.state.metrics
    core: CoreClient = request.app.state.core
    request_id = request.state.request_id
    stats, relayed = await asyncio.gather(
        core.stats(request_id), core.metrics(request_id), return_exceptions=True
    )
    body = b""
    for reply in (stats, relayed):  # scrape anyway: the gateway's own series are still true
        if isinstance(reply, grpc.aio.AioRpcError):
            log.debug("core unavailable for /metrics", grpc_code=reply.code().name)
        elif isinstance(reply, BaseException):
            raise reply
    if isinstance(stats, core_pb2.CoreStats):
        registry.set_core_gauges(await served_model_name(request), stats)
    if isinstance(relayed, core_pb2.GetMetricsResponse):
        body = relayed_exposition(relayed)
    return Response(registry.exposition() + body, media_type=CONTENT_TYPE_LATEST)
