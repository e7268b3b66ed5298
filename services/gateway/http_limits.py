"""Connection-level limits uvicorn does not set: how long a client may take to send its headers,
how large they may be, and how long a request body may stall or trickle.

uvicorn closes a keep-alive connection idle between requests, but not one that was opened and never
used, one that drips its headers a byte at a time, one whose headers grow without end, or one that
stops sending the body it announced or sends it a byte at a time: each holds a socket (and a
buffer) for as long as the client likes. This protocol bounds them all, so a crowd of such clients
costs the gateway a bounded number of sockets for a bounded time, and the clients that do send
requests are served meanwhile.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from services.gateway.memory_bound import MAX_HEADER_BYTES

HEADER_TIMEOUT_S = 10.0  # connection made (or previous response sent) -> the headers complete
BODY_IDLE_TIMEOUT_S = 30.0  # the longest pause inside a request body
BODY_GRACE_S = 10.0  # a body may take this long, plus its size at MIN_BODY_BYTES_PER_S
MIN_BODY_BYTES_PER_S = 16 * 1024


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header deadline, a header size cap, and a body that must
    not stall nor fall below a minimum rate (408 / 431, then the connection is closed); a
    connection beyond `max_connections` open ones gets 503 and is closed at once."""

    max_connections: int | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.max_connections is not None and len(self.server_state.connections) > self.max_connections:
            self._timer = None
            self._refuse(503, f"the gateway holds its maximum of {self.max_connections} connections")
            return
        self._header_bytes = 0
        self._header_tail = b""  # the last bytes counted, for a blank line split across chunks
        self._in_headers = True
        self._timer: asyncio.TimerHandle | None = None
        self._arm(HEADER_TIMEOUT_S, 408, "the request headers did not arrive in time")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """Headers are counted before they are parsed, up to their blank line, so headers that end
        in the same chunk as they overflow are refused too (a body in that chunk is not counted)."""
        if self._in_headers and not self.transport.is_closing():
            seen = self._header_tail + data
            end = seen.find(b"\r\n\r\n")
            self._header_bytes += len(data) if end < 0 else max(0, end + 4 - len(self._header_tail))
            self._header_tail = seen[-3:]
            if self._header_bytes > MAX_HEADER_BYTES:
                self._refuse(431, f"request headers exceed {MAX_HEADER_BYTES} bytes")
                return
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._in_headers:  # a further request on a kept-alive connection
            self._in_headers, self._header_bytes, self._header_tail = True, 0, b""
            self._arm(HEADER_TIMEOUT_S, 408, "the request headers did not arrive in time")

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._body_started, self._body_bytes = self.loop.time(), 0
        self._arm(BODY_IDLE_TIMEOUT_S, 408, "the request body stalled")
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        allowed = BODY_GRACE_S + self._body_bytes / MIN_BODY_BYTES_PER_S
        if self.loop.time() - self._body_started > allowed:
            self._refuse(408, f"the request body arrives slower than {MIN_BODY_BYTES_PER_S} bytes/s")
            return
        self._arm(BODY_IDLE_TIMEOUT_S, 408, "the request body stalled")
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def _arm(self, seconds: float, status: int, reason: str) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._refuse, status, reason)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _refuse(self, status: int, reason: str) -> None:
        """Answer `status` where no response has started, then close the connection."""
        self._disarm()
        if self.transport.is_closing():
            return
        if self.cycle is None or not self.cycle.response_started:
            body = reason.encode()
            phrase = {
                408: b"Request Timeout",
                431: b"Request Header Fields Too Large",
                503: b"Service Unavailable",
            }[status]
            self.transport.write(
                b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n%s" % (status, phrase, len(body), body)
            )
        self.logger.warning("connection closed: %s", reason)
        self.transport.close()


def guarded_protocol(max_connections: int | None) -> type[GuardedHttpToolsProtocol]:
    """The protocol class for a server that keeps at most `max_connections` open."""
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), {"max_connections": max_connections})
