"""The id of the model core serves, asked once and remembered (it cannot change while core runs
with the same split; a restarted core with another model is noticed on the next failure)."""

from __future__ import annotations

import grpc
from fastapi import Request

from services.gateway.core_client import CoreClient


async def served_model_name(request: Request) -> str:
    state = request.app.state
    if state.served_model is None:
        core: CoreClient = state.core
        try:
            models = await core.list_models(request.state.request_id)
        except grpc.aio.AioRpcError:
            # Generate will report core's problem with the right status; the name is cosmetic.
            return state.model_name_hint or ""
        state.served_model = models[0].id if models else ""
    return state.served_model or state.model_name_hint or ""
