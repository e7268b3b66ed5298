"""Anthropic route: `POST /v1/messages` (errors in Anthropic's shape, see `errors.py`)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from services.gateway.anthropic_format import AnthropicFormatter
from services.gateway.anthropic_mapping import build_messages_request
from services.gateway.anthropic_schema import MessagesRequest
from services.gateway.generation import serve_generation
from services.gateway.generation_state import CompletionMeta
from services.gateway.routes_openai import response_id

router = APIRouter()


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request) -> Response:
    request_id: str = request.state.request_id
    meta = CompletionMeta(id=response_id("msg_", request_id), created=0, model=body.model)
    return await serve_generation(
        request,
        build_messages_request(body, request_id),
        AnthropicFormatter(meta),
        stream=body.stream,
        model_label=body.model,
    )
