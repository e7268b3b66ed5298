"""The gateway's own flags, shared by `moe-mesh gateway` and `moe-mesh up` (which passes them on)."""

from __future__ import annotations

import argparse

from services.common.cli_types import positive_int
from services.gateway.memory_bound import DEFAULT_MAX_CONNECTIONS, DEFAULT_REQUEST_MEMORY_MB


def origins(value: str) -> tuple[str, ...]:
    """`--allowed-origins`: `*`, or scheme://host[:port] origins separated by commas."""
    found = tuple(o.strip().rstrip("/") for o in value.split(",") if o.strip())
    for origin in found:
        if origin != "*" and ("://" not in origin or "/" in origin.split("://", 1)[1]):
            raise argparse.ArgumentTypeError(f"{origin!r} is not an origin (scheme://host[:port], or *)")
    return found


def add_gateway_flags(p: argparse.ArgumentParser) -> None:
    """`moe-mesh gateway`'s API-key, memory and image flags (`up` takes them too)."""
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require this key on /v1/* (repeatable; also MOE_MESH_API_KEY, comma-separated)",
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        help="file with one accepted API key per line, or its hash as sha256:<hex> (sha256sum)",
    )
    p.add_argument("--protect-metrics", action="store_true", help="require an API key on /metrics too")
    p.add_argument(
        "--allowed-origins",
        type=origins,
        default=(),
        help="browser origins allowed to call the API (CORS), comma-separated, e.g. "
        "http://localhost:3000, or * for any (default: none, no CORS headers)",
    )
    p.add_argument(
        "--max-connections",
        type=positive_int,
        default=DEFAULT_MAX_CONNECTIONS,
        help="open HTTP connections (then 503)",
    )
    p.add_argument(
        "--max-request-memory-mb",
        type=positive_int,
        default=DEFAULT_REQUEST_MEMORY_MB,
        help="request bodies held at once (then 429); with --max-connections it bounds the gateway's memory",
    )
    p.add_argument(
        "--allow-image-urls",
        action="store_true",
        help="fetch http(s) image URLs sent in chats (default: only inline images, data: URLs and base64), "
        "from public addresses only",
    )
    p.add_argument(
        "--allow-private-image-urls",
        action="store_true",
        help="with --allow-image-urls, also fetch from loopback, private and link-local addresses "
        "(the gateway's own network: only where every client is trusted)",
    )


def gateway_pass_args(args: argparse.Namespace) -> list[str]:
    """`up` passes its key, limit and image flags through to the gateway (MOE_MESH_API_KEY is inherited)."""
    out = [flag for key in args.api_key or () for flag in ("--api-key", key)]
    out += ["--protect-metrics"] if args.protect_metrics else []
    out += ["--allowed-origins", ",".join(args.allowed_origins)] if args.allowed_origins else []
    out += ["--max-connections", str(args.max_connections)]
    out += ["--max-request-memory-mb", str(args.max_request_memory_mb)]
    out += ["--allow-image-urls"] if args.allow_image_urls else []
    out += ["--allow-private-image-urls"] if args.allow_private_image_urls else []
    return out + (["--api-key-file", args.api_key_file] if args.api_key_file else [])
