"""Anthropic routes: `POST /v1/messages` and `POST /v1/messages/count_tokens` (which Claude Code and
other agents call to budget their context); errors in Anthropic's shape, see `errors.py`."""

from __future__ import annotations

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import Response

from services.gateway.anthropic_format import AnthropicFormatter
from services.gateway.anthropic_mapping import build_messages_request, chat_input
from services.gateway.anthropic_schema import MessagesInput, MessagesRequest
from services.gateway.core_client import CoreClient
from services.gateway.errors import error_from_grpc
from services.gateway.generation import serve_generation
from services.gateway.generation_state import CompletionMeta
from services.gateway.image_parts import ImageLoader, messages_image_sources
from services.gateway.routes_openai import response_id
from services.gateway.served_model import image_refusal

router = APIRouter()


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request) -> Response:
    request_id: str = request.state.request_id
    meta = CompletionMeta(id=response_id("msg_", request_id), created=0, model=body.model)
    loader: ImageLoader = request.app.state.images
    sources = messages_image_sources(body)
    async with loader.load(sources, await image_refusal(request, sources)) as images:
        return await serve_generation(
            request,
            build_messages_request(body, request_id, images),
            AnthropicFormatter(meta),
            stream=body.stream,
            model_label=body.model,
        )


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: MessagesInput, request: Request) -> dict[str, int]:
    core: CoreClient = request.app.state.core
    loader: ImageLoader = request.app.state.images
    sources = messages_image_sources(body)
    async with loader.load(sources, await image_refusal(request, sources)) as images:
        try:
            count = await core.count_tokens(
                chat_input(body, images), request.state.request_id, model=body.model
            )
        except grpc.aio.AioRpcError as error:
            raise error_from_grpc(error) from None
    return {"input_tokens": count}
