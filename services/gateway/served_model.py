"""The model core serves, asked once and remembered (it cannot change while core runs with the same
split; a restarted core with another model is noticed on the next failure)."""

from __future__ import annotations

import grpc
from fastapi import Request

from services.gateway.core_client import CoreClient
from services.proto.moemesh.v1 import core_pb2


async def served_model_info(request: Request) -> core_pb2.ModelInfo | None:
    """Core's ModelInfo for its model, or None while core cannot be asked (Generate will report
    core's problem with the right status)."""
    state = request.app.state
    if state.served_model is None:
        core: CoreClient = state.core
        try:
            models = await core.list_models(request.state.request_id)
        except grpc.aio.AioRpcError:
            return None
        state.served_model = models[0] if models else core_pb2.ModelInfo()
    return state.served_model


async def served_model_name(request: Request) -> str:
    info = await served_model_info(request)
    return (info.id if info is not None else "") or request.app.state.model_name_hint or ""


async def image_refusal(request: Request, sources: list) -> str:
    """Why the served model refuses a request with images (`sources`), e.g. "model 'x' takes text
    only"; "" where it takes them, or there are none."""
    if not sources:
        return ""
    info = await served_model_info(request)
    if info is None or not info.images_refused:
        return ""
    return f"model {info.id!r} {info.images_refused}"
