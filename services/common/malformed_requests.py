"""A request whose bytes do not parse is the client's error: INVALID_ARGUMENT, saying so.

grpcio answers a message its deserializer cannot parse with UNKNOWN ("Unexpected
DecodeError"), as if the server had failed. This interceptor, installed on every server
(services/common/grpc_util.start_server), parses with a deserializer that hands the servicer
nothing and the method an abort with INVALID_ARGUMENT instead: for unary requests before the
servicer runs, for streamed requests when the stream reaches the bad message (the calls
before it were already answered; the stream ends there, since the bad message has no call id
to answer in-band).
"""

from __future__ import annotations

import inspect

import grpc


class MalformedRequest:
    """What the tolerant deserializer returns for bytes that do not parse."""

    __slots__ = ("error",)

    def __init__(self, error: Exception):
        self.error = error


def _tolerant(deserialize):
    def parse(data: bytes):
        try:
            return deserialize(data)
        except Exception as error:  # noqa: BLE001 - protobuf's DecodeError, or any parser's error
            return MalformedRequest(error)

    return parse


async def _abort(context, method: str, request: MalformedRequest):
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"{method}: the request message does not parse: {request.error}",
    )


async def _checked(request, context, method: str, streamed: bool):
    """The request itself, refused when it did not parse; or a stream of them refused at the
    first that did not."""
    if streamed:
        return _checked_requests(request, context, method)
    if isinstance(request, MalformedRequest):
        await _abort(context, method, request)
    return request


def _checked_requests(requests, context, method):
    async def checked():
        async for request in requests:
            if isinstance(request, MalformedRequest):
                await _abort(context, method, request)
            yield request

    return checked()


def _checked_unary_response(behavior, method: str, streamed: bool):
    async def handle(request, context):
        return await behavior(await _checked(request, context, method, streamed), context)

    return handle


def _checked_response_stream(behavior, method: str, streamed: bool):
    async def handle(request, context):
        result = behavior(await _checked(request, context, method, streamed), context)
        if inspect.isasyncgen(result):
            async for reply in result:
                yield reply
        else:  # a handler that writes through context.write
            await result

    return handle


# handler kind: (wrapper, whether the requests come as a stream)
_WRAPPERS = {
    "unary_unary": (_checked_unary_response, False),
    "unary_stream": (_checked_response_stream, False),
    "stream_unary": (_checked_unary_response, True),
    "stream_stream": (_checked_response_stream, True),
}


class RejectMalformedRequests(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        changes = {"request_deserializer": _tolerant(handler.request_deserializer)}
        for kind, (wrap, streamed) in _WRAPPERS.items():
            behavior = getattr(handler, kind)
            if behavior is not None:
                if not inspect.iscoroutinefunction(behavior) and not inspect.isasyncgenfunction(behavior):
                    return handler  # a synchronous handler (not used here): left as grpcio runs it
                changes[kind] = wrap(behavior, method, streamed)
        return handler._replace(**changes)
