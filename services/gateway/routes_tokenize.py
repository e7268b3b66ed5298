"""vLLM's `POST /tokenize` and `POST /detokenize`: the token ids core would generate from (a
prompt, or a chat through the model's chat template) and token ids back to text."""

from __future__ import annotations

from typing import Annotated

import grpc
from fastapi import APIRouter, Request
from pydantic import Field

from services.gateway.core_client import CoreClient
from services.gateway.errors import error_from_grpc
from services.gateway.generate_mapping import chat_input
from services.gateway.image_parts import ImageLoader, chat_image_sources
from services.gateway.openai_schema import UINT32_MAX, ApiModel, ChatCompletionRequest
from services.gateway.served_model import image_refusal
from services.proto.moemesh.v1 import core_pb2

router = APIRouter()


class TokenizePromptRequest(ApiModel):
    model: str | None = None
    prompt: str = Field(min_length=1)


class DetokenizeRequest(ApiModel):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=UINT32_MAX)]]


@router.post("/tokenize")
async def tokenize(body: TokenizePromptRequest | ChatCompletionRequest, request: Request) -> dict:
    core: CoreClient = request.app.state.core
    count = core_pb2.CountTokensRequest(model=body.model or "", return_ids=True)
    loader: ImageLoader = request.app.state.images
    sources = [] if isinstance(body, TokenizePromptRequest) else chat_image_sources(body)
    async with loader.load(sources, await image_refusal(request, sources)) as images:
        if isinstance(body, TokenizePromptRequest):
            count.prompt = body.prompt
        else:
            count.chat.CopyFrom(chat_input(body, images))
        try:
            ids = await core.tokenize(count, request.state.request_id)
            models = await core.list_models(request.state.request_id)
        except grpc.aio.AioRpcError as error:
            raise error_from_grpc(error) from None
    context = models[0].context_length if models else 0
    return {"count": len(ids), "max_model_len": context or None, "tokens": ids}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    core: CoreClient = request.app.state.core
    try:
        text = await core.detokenize(body.tokens, request.state.request_id, model=body.model or "")
    except grpc.aio.AioRpcError as error:
        raise error_from_grpc(error) from None
    return {"prompt": text}
