"""Thin async client for the core's gRPC API, and the chat request → `GenerateRequest` mapping.

Contract:
- one `grpc.aio` channel per gateway process, created inside the running event loop (grpc.aio
  objects belong to the loop that made them), with explicit message size caps;
- every call carries the request id in the `x-request-id` metadata key, so core's log lines for
  the request can be joined with the gateway's, and has a deadline (`Generate` default 600 s, the
  small unary calls and health 5 s): a core that hangs becomes a 504, not a stuck HTTP client;
- errors are not translated here: callers get `grpc.aio.AioRpcError` and map it with
  `errors.error_from_grpc`, which keeps this file free of HTTP knowledge.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_util import channel_options, normalize_address
from services.common.logging import REQUEST_ID_METADATA_KEY
from services.gateway.openai_schema import ChatCompletionRequest, ChatMessage
from services.proto.moemesh.v1 import core_pb2, core_pb2_grpc

UINT64_MASK = 2**64 - 1
CORE_HEALTH_SERVICE_NAMES = ("moemesh.v1.Core", "")  # the specific service first, then the server


@dataclass(frozen=True)
class CoreClientConfig:
    target: str  # "unix:///run/moe-mesh/core.sock" or "127.0.0.1:50051"
    generate_timeout_s: float = 600.0
    unary_timeout_s: float = 5.0
    max_message_bytes: int = 64 * 1024 * 1024


class CoreClient:
    """Async wrapper around the core stub; construct it inside the event loop that will use it."""

    def __init__(self, config: CoreClientConfig) -> None:
        self.config = config
        # channel_options: explicit size caps and a short reconnect backoff, so a gateway that
        # started before core (or outlived a core restart) reaches it within ~2 s of it coming up.
        self._channel = grpc.aio.insecure_channel(
            normalize_address(config.target), options=channel_options(config.max_message_bytes)
        )
        self._core = core_pb2_grpc.CoreStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    @staticmethod
    def _metadata(request_id: str) -> tuple[tuple[str, str], ...]:
        return ((REQUEST_ID_METADATA_KEY, request_id),)

    def generate(self, request: core_pb2.GenerateRequest) -> grpc.aio.UnaryStreamCall:
        """Start `Core.Generate`; iterate the returned call for chunks, `.cancel()` it to free the
        sequence in core. The call starts immediately, errors surface on the first read."""
        return self._core.Generate(
            request,
            metadata=self._metadata(request.request_id),
            timeout=self.config.generate_timeout_s,
        )

    async def list_models(self, request_id: str) -> list[core_pb2.ModelInfo]:
        response = await self._core.ListModels(
            core_pb2.ListModelsRequest(),
            metadata=self._metadata(request_id),
            timeout=self.config.unary_timeout_s,
        )
        return list(response.models)

    async def health(self) -> str:
        """Core's grpc.health.v1 status name: SERVING, NOT_SERVING, ... or UNREACHABLE.

        Never raises: health is reported, not propagated, so `/health` can answer while core is down.
        """
        for service in CORE_HEALTH_SERVICE_NAMES:
            try:
                response = await self._health.Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=self.config.unary_timeout_s
                )
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.NOT_FOUND:
                    continue  # core did not register this service name; try the next one
                if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    return "UNREACHABLE"
                return "UNKNOWN"
            return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
        return "SERVICE_UNKNOWN"

    async def close(self) -> None:
        await self._channel.close(grace=None)


def build_generate_request(request: ChatCompletionRequest, request_id: str) -> core_pb2.GenerateRequest:
    """Map a validated chat request to core's wire message; unset options stay unset so core applies
    the model's own defaults (generation_config) rather than ours."""
    chat = core_pb2.ChatInput(
        messages=[_chat_message(message) for message in request.messages],
        add_generation_prompt=True,
    )
    # tool_choice "none" means the model must not call tools: do not show it any.
    if request.tools and request.tool_choice != "none":
        chat.tools.extend(
            core_pb2.Tool(
                name=tool.function.name,
                description=tool.function.description,
                parameters_json=json.dumps(tool.function.parameters) if tool.function.parameters else "",
            )
            for tool in request.tools
        )
    if request.chat_template_kwargs:
        chat.template_kwargs_json = json.dumps(request.chat_template_kwargs)

    sampling = core_pb2.SamplingParams()
    for field in (
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    ):
        value = getattr(request, field)
        if value is not None:
            setattr(sampling, field, value)
    if request.top_k is not None and request.top_k > 0:  # -1 and 0 both mean "no top-k"
        sampling.top_k = request.top_k
    if request.seed is not None:
        sampling.seed = request.seed & UINT64_MASK  # OpenAI seeds are signed; core's are uint64

    stopping = core_pb2.StoppingCriteria(
        stop=request.stop_sequences(),
        stop_token_ids=request.stop_token_ids or [],
        ignore_eos=request.ignore_eos,
    )
    if (max_tokens := request.max_new_tokens()) is not None:
        stopping.max_tokens = max_tokens

    return core_pb2.GenerateRequest(
        request_id=request_id,
        model=request.model,
        chat=chat,
        sampling=sampling,
        stopping=stopping,
        logprobs=request.logprobs,
        top_logprobs=request.top_logprobs or 0,
    )


def _chat_message(message: ChatMessage) -> core_pb2.ChatMessage:
    return core_pb2.ChatMessage(
        role=message.role,
        content=message.text(),
        name=message.name or "",
        tool_call_id=message.tool_call_id or "",
        tool_calls=[
            core_pb2.ToolCall(id=call.id, name=call.function.name, arguments=call.function.arguments)
            for call in message.tool_calls or []
        ],
    )
