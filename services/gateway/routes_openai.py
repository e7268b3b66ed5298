"""OpenAI routes: `POST /v1/chat/completions` and `POST /v1/completions`.

Thin: validate (pydantic, 400 on failure), load the chat's images (image_parts, 400 for a bad one),
map to `GenerateRequest`s (one per choice), hand to `serve_generations` with the API's formatters.
The response id embeds the request id, so a client's id finds the logs.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from services.gateway.chat_format import ChatFormatter
from services.gateway.completions_format import CompletionFormatter
from services.gateway.completions_schema import CompletionRequest
from services.gateway.generate_mapping import build_chat_requests, build_completion_requests
from services.gateway.generation import serve_generations
from services.gateway.generation_state import CompletionMeta
from services.gateway.image_parts import ImageLoader, chat_image_sources
from services.gateway.openai_schema import ChatCompletionRequest
from services.gateway.served_model import image_refusal, served_model_name

router = APIRouter()


def response_id(prefix: str, request_id: str) -> str:
    return request_id if request_id.startswith(prefix) else f"{prefix}{request_id}"


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    request_id: str = request.state.request_id
    model = body.model or await served_model_name(request)
    meta = CompletionMeta(id=response_id("chatcmpl-", request_id), created=int(time.time()), model=model)
    loader: ImageLoader = request.app.state.images
    sources = chat_image_sources(body)
    async with loader.load(sources, await image_refusal(request, sources)) as images:
        generates = build_chat_requests(body, request_id, images)
        usage, logprobs = body.include_usage_in_stream(), body.logprobs
        formatters = [
            ChatFormatter(meta, include_usage=usage, with_logprobs=logprobs, index=i)
            for i in range(len(generates))
        ]
        return await serve_generations(
            request, generates, formatters, n=body.n, stream=body.stream, model_label=model
        )


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    body.check_max_tokens()
    request_id: str = request.state.request_id
    model = body.model or await served_model_name(request)
    meta = CompletionMeta(id=response_id("cmpl-", request_id), created=int(time.time()), model=model)
    generates = build_completion_requests(body, request_id)
    usage, logprobs = body.include_usage_in_stream(), body.logprobs is not None
    formatters = [
        CompletionFormatter(meta, include_usage=usage, with_logprobs=logprobs, index=i)
        for i in range(len(generates))
    ]
    return await serve_generations(
        request, generates, formatters, n=body.n, stream=body.stream, model_label=model
    )
