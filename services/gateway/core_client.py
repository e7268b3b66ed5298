"""Thin async client for the core's gRPC API.

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

from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_util import aio_channel
from services.common.logging import REQUEST_ID_METADATA_KEY
from services.common.tls import TlsFiles
from services.proto.moemesh.v1 import core_pb2, core_pb2_grpc

CORE_HEALTH_SERVICE_NAMES = ("moemesh.v1.Core", "")  # the specific service first, then the server


@dataclass(frozen=True)
class CoreClientConfig:
    target: str  # "unix:///run/moe-mesh/core.sock" or "127.0.0.1:50051"
    generate_timeout_s: float = 600.0
    unary_timeout_s: float = 5.0
    max_message_bytes: int = 64 * 1024 * 1024
    tls: TlsFiles | None = None  # mTLS to core (the gateway's certificate from `moe-mesh certs`)


class CoreClient:
    """Async wrapper around the core stub; construct it inside the event loop that will use it."""

    def __init__(self, config: CoreClientConfig) -> None:
        self.config = config
        # aio_channel: explicit size caps and a short reconnect backoff, so a gateway that
        # started before core (or outlived a core restart) reaches it within ~2 s of it coming up.
        self._channel = aio_channel(config.target, config.tls, config.max_message_bytes)
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

    async def count_tokens(self, chat: core_pb2.ChatInput, request_id: str, model: str = "") -> int:
        """Prompt tokens of `chat` after the model's chat template (tools included); NOT_FOUND
        when `model` is given and not the served one."""
        response = await self._core.CountTokens(
            core_pb2.CountTokensRequest(chat=chat, model=model),
            metadata=self._metadata(request_id),
            timeout=self.config.unary_timeout_s,
        )
        return response.count

    async def tokenize(self, request: core_pb2.CountTokensRequest, request_id: str) -> list[int]:
        """The token ids core would generate from (the chat template applied to a chat); the
        request asks for them (`return_ids`)."""
        response = await self._core.CountTokens(
            request, metadata=self._metadata(request_id), timeout=self.config.unary_timeout_s
        )
        return list(response.ids)

    async def detokenize(self, ids: list[int], request_id: str, model: str = "") -> str:
        response = await self._core.Detokenize(
            core_pb2.DetokenizeRequest(ids=ids, model=model),
            metadata=self._metadata(request_id),
            timeout=self.config.unary_timeout_s,
        )
        return response.text

    async def stats(self, request_id: str = "") -> core_pb2.CoreStats:
        """Core's counters and gauges (running/waiting requests) for `/metrics`."""
        return await self._core.GetStats(
            core_pb2.GetStatsRequest(),
            metadata=self._metadata(request_id),
            timeout=self.config.unary_timeout_s,
        )

    async def metrics(self, request_id: str = "") -> core_pb2.GetMetricsResponse:
        """Core's and every worker's Prometheus text, for one scrape target at the gateway."""
        return await self._core.GetMetrics(
            core_pb2.GetMetricsRequest(),
            metadata=self._metadata(request_id),
            timeout=self.config.unary_timeout_s,
        )

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
