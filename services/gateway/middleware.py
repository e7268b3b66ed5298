"""ASGI middleware: request ids and the request body size cap.

`RequestIdMiddleware` contract: every HTTP request gets an id — the client's `X-Request-Id` if it is
a sane token, otherwise a fresh uuid hex — stored in `request.state.request_id`, bound into
structlog's contextvars for every log line the request causes, and returned in the `X-Request-Id`
response header (also on errors). It is also the last line of defence: an unexpected exception
becomes the OpenAI 500 envelope with no traceback, which is logged instead.

Pure ASGI (not `BaseHTTPMiddleware`) so streaming responses pass through untouched and the
contextvars binding covers the whole response, including the SSE generator.
"""

from __future__ import annotations

import re
import uuid

import structlog
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.common.logging import get_logger
from services.gateway.errors import CodedHTTPException, OpenAIError, internal_error
from services.gateway.memory_bound import RequestMemoryBudget

REQUEST_ID_HEADER = "X-Request-Id"
# The id travels into gRPC metadata and log lines: keep it to characters that are safe in both.
_ACCEPTABLE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")

log = get_logger(__name__)


def new_request_id() -> str:
    return uuid.uuid4().hex


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        offered = Headers(scope=scope).get(REQUEST_ID_HEADER, "")
        request_id = offered if _ACCEPTABLE_REQUEST_ID.fullmatch(offered) else new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id
        response_started = False

        async def send_with_request_id(message: Message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
            await send(message)

        with structlog.contextvars.bound_contextvars(request_id=request_id):
            try:
                await self.app(scope, receive, send_with_request_id)
            except Exception:
                log.exception("unhandled error", path=scope.get("path"))
                if not response_started:
                    await internal_error().response(path=scope.get("path", ""))(
                        scope, receive, send_with_request_id
                    )
                # A response already under way cannot change status; returning ends it.


class BodySizeLimitMiddleware:
    """Refuse request bodies over `max_body_bytes` with 413 before they are buffered whole, and
    bodies that do not fit the budget of all requests in flight (`budget`) with 429.

    Checks Content-Length up front and counts streamed (chunked) bodies as they arrive, so a
    client cannot make the gateway hold an unbounded body in memory. A request holds its share of
    the budget until its response ends: what the handler made of the body lives that long.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int, budget: RequestMemoryBudget | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.budget = budget

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        too_large = OpenAIError(
            413, f"request body exceeds {self.max_body_bytes} bytes", code="body_too_large"
        )
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            await too_large.response(path=path)(scope, receive, send)
            return
        held = int(declared) if declared.isdigit() else 0  # bytes of the budget this request holds
        if not self._reserve(held):
            await self._busy().response({"Retry-After": "1"}, path=path)(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received, held
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:  # the same 413 as a declared length gets
                    raise CodedHTTPException(too_large)
                if received > held:  # a chunked body, or one longer than it declared
                    if not self._reserve(received - held):
                        raise CodedHTTPException(self._busy(), headers={"Retry-After": "1"})
                    held = received
            return message

        try:
            await self.app(scope, counting_receive, send)
        finally:
            if self.budget is not None:
                self.budget.release(held)

    def _reserve(self, nbytes: int) -> bool:
        return self.budget is None or self.budget.reserve(nbytes)

    def _busy(self) -> OpenAIError:
        limit = self.budget.limit_bytes // (1024 * 1024) if self.budget else 0
        return OpenAIError(
            429, f"the gateway is busy: request bodies in flight fill its {limit} MiB", code="gateway_busy"
        )
