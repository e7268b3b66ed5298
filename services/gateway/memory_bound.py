"""What bounds the gateway's memory, and the budget that enforces it.

The gateway holds little of its own: its code and libraries, one buffer per open connection
(headers up to MAX_HEADER_BYTES while they arrive, uvicorn's write buffer while a response drains),
and each request in flight: its body and what the handler makes of it (parsed JSON, the validated
request, the gRPC message, the answer's text). Connections are capped (`--max-connections`) and the
bodies of the requests in flight share one budget (`--max-request-memory-mb`): a request whose body
does not fit gets 429 with Retry-After and is never read. Images add their own work: files being
fetched (--allow-image-urls; once fetched they are held in the same budget) and the pixels of the
images being checked, each capped in size and in how many run at once (image_parts.py). So the
gateway's memory is at most `gateway_bound_bytes(...)`, which `moe-mesh plan` states.
"""

from __future__ import annotations

MIB = 1024 * 1024
MAX_HEADER_BYTES = 64 * 1024  # request line and headers (http_limits.py enforces it)
DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_REQUEST_MEMORY_MB = 64
# the gateway idle, serving: interpreter, FastAPI, grpcio, the tokenizer-free gateway code (~100 MB
# measured on Linux and macOS), with room
BASE_BYTES = 160 * MIB
# per open connection: its header buffer at the cap and uvicorn's write buffer (64 KiB high water)
PER_CONNECTION_BYTES = MAX_HEADER_BYTES + 64 * 1024
# what a request's body becomes in the handler, per body byte, at most: the raw body, its parsed
# JSON, the validated request and the gRPC message. Python objects make a body of many small
# messages or tools the worst case (~21x); tests/gateway/test_memory_bound.py measures it.
BODY_EXPANSION = 24
IMAGE_FETCHES_AT_ONCE = 4
IMAGE_DECODES_AT_ONCE = 1  # the largest image allowed decodes in ~0.3 s, a photo in milliseconds


def image_work_bytes() -> int:
    """Downloads (each its buffer and the file copied out of it) and checks (each the decoded frame,
    up to 4 bytes a pixel, and its RGB copy, 3, with room) at their caps and counts at once."""
    # here, not at the top: images.py loads numpy, which the command line need not wait for
    from services.common.images import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS

    return (
        IMAGE_FETCHES_AT_ONCE * 2 * DEFAULT_MAX_IMAGE_BYTES
        + IMAGE_DECODES_AT_ONCE * 8 * DEFAULT_MAX_IMAGE_PIXELS
    )


def gateway_bound_bytes(
    max_connections: int = DEFAULT_MAX_CONNECTIONS, request_memory_mb: int = DEFAULT_REQUEST_MEMORY_MB
) -> int:
    return (
        BASE_BYTES
        + max_connections * PER_CONNECTION_BYTES
        + request_memory_mb * MIB * BODY_EXPANSION
        + image_work_bytes()
    )


class RequestMemoryBudget:
    """Bytes of request bodies in flight, against a cap. `reserve(n)` is all-or-nothing."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self.in_flight = 0

    def reserve(self, nbytes: int) -> bool:
        if self.in_flight + nbytes > self.limit_bytes:
            return False
        self.in_flight += nbytes
        return True

    def release(self, nbytes: int) -> None:
        self.in_flight -= nbytes
