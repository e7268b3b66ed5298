"""Optional API keys for the `/v1/*` routes.

Contract: with no keys configured (the default) every request passes. With keys, a `/v1/*` request
must present one as `Authorization: Bearer <key>` (OpenAI clients) or `x-api-key: <key>` (Anthropic
clients), else 401 in the API's error shape. The presented key's SHA-256 is compared with
`hmac.compare_digest` against every configured key's, without stopping at the first match, so
response time does not reveal how much of a key was right. `/health`, `/ready` and `/openapi.json`
stay open: probes run inside the trust boundary, as with vLLM's `--api-key`; `/metrics` too, unless
`--protect-metrics` puts it behind the keys. The status page (`/status`, its assets and
`/status.json`) is behind the keys as the API is; a browser, which cannot send a bearer token
when it opens a page, may also present a key as the password of HTTP Basic authentication
(any user name): the 401 there asks the browser for it.

Keys come from `--api-key` flags, an `--api-key-file` (one key per line, `#` comments), and the
`MOE_MESH_API_KEY` environment variable (comma-separated), all merged. An entry `sha256:<64 hex>` is
a key's hash (`printf %s "$KEY" | sha256sum`), so a key file need not hold the keys themselves.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re
from collections.abc import Iterable
from pathlib import Path

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from services.gateway.errors import ANTHROPIC_PATH_PREFIX, OpenAIError

API_KEY_ENV = "MOE_MESH_API_KEY"
PROTECTED_PREFIX = "/v1/"
METRICS_PATHS = ("/metrics",)  # behind the keys with --protect-metrics
STATUS_PATHS = ("/status", "/status.json")
STATIC_PREFIX = "/static/"  # the status page's assets
HASH_PREFIX = "sha256:"
_HASH = re.compile(r"sha256:[0-9a-fA-F]{64}")


def load_api_keys(
    keys: Iterable[str] = (), key_file: str | Path | None = None, environ: dict[str, str] | None = None
) -> tuple[str, ...]:
    """Merge the keys from flags, a file and the environment; empty entries are ignored.

    Raises ValueError for an unreadable key file, or when keys were asked for (a flag, a file, the
    variable set) and none came out (an empty file, only comments, " , "): the gateway refuses to
    start open by mistake.
    """
    keys = list(keys)
    collected = [key.strip() for key in keys]
    if key_file is not None:
        try:
            lines = Path(key_file).read_text().splitlines()
        except OSError as error:
            raise ValueError(f"cannot read API key file {key_file}: {error.strerror}") from None
        collected += [line.strip() for line in lines if not line.strip().startswith("#")]
    environment = os.environ if environ is None else environ
    collected += [key.strip() for key in environment.get(API_KEY_ENV, "").split(",")]
    found = tuple(dict.fromkeys(key for key in collected if key))
    for key in found:
        if key.startswith(HASH_PREFIX) and not _HASH.fullmatch(key):
            raise ValueError(f"API key entry {key[:20]}...: a hash is sha256: and 64 hex digits")
    from_environment = bool(environment.get(API_KEY_ENV, "").strip())  # set but empty: not asked
    if (keys or key_file is not None or from_environment) and not found:
        sources = [f"--api-key-file {key_file}" if key_file is not None else "", "--api-key" if keys else ""]
        sources.append(API_KEY_ENV if from_environment else "")
        raise ValueError(f"API keys were asked for ({', '.join(s for s in sources if s)}) but none is set")
    return found


def is_status_page(path: str) -> bool:
    """The status page, its data or its assets: behind the keys, which a browser may send as Basic."""
    return path in STATUS_PATHS or path.startswith(STATIC_PREFIX)


def presented_key(headers: Headers, basic: bool = False) -> str:
    """The key a request presents; `basic`: also as an HTTP Basic password (the status page)."""
    authorization = headers.get("authorization", "")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    if basic and scheme.lower() == "basic" and token.strip():
        try:
            return base64.b64decode(token.strip(), validate=True).decode().partition(":")[2]
        except (ValueError, UnicodeDecodeError):
            return ""
    return headers.get("x-api-key", "").strip()


def key_digest(entry: str) -> bytes:
    """The SHA-256 an accepted key entry stands for: its own, or the one it gives (sha256:…)."""
    if _HASH.fullmatch(entry):
        return bytes.fromhex(entry.removeprefix(HASH_PREFIX))
    return hashlib.sha256(entry.encode()).digest()


def key_matches(presented: str, digests: tuple[bytes, ...]) -> bool:
    candidate = hashlib.sha256(presented.encode()).digest()
    matched = False
    for digest in digests:  # no early exit: every key is compared every time
        matched |= hmac.compare_digest(candidate, digest)
    return matched


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: tuple[str, ...], protect_metrics: bool = False) -> None:
        self.app = app
        self.digests = tuple(key_digest(key) for key in keys)
        self.extra_paths = METRICS_PATHS if protect_metrics else ()

    def protects(self, path: str) -> bool:
        return bool(self.digests) and (
            path.startswith(PROTECTED_PREFIX) or path in self.extra_paths or is_status_page(path)
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not self.protects(path):
            await self.app(scope, receive, send)
            return
        presented = presented_key(Headers(scope=scope), basic=is_status_page(path))
        if presented and key_matches(presented, self.digests):
            await self.app(scope, receive, send)
            return
        header = (
            "x-api-key: <key>" if path.startswith(ANTHROPIC_PATH_PREFIX) else "Authorization: Bearer <key>"
        )
        message = "invalid API key" if presented else f"missing API key (send {header})"
        error = OpenAIError(401, message, code="invalid_api_key")
        # The page itself asks a browser for the key; its data (fetched by the page) must not pop
        # a second dialog, the browser resends what the page's 401 collected.
        challenge = 'Basic realm="moe-mesh", charset="UTF-8"' if path == "/status" else "Bearer"
        await error.response({"WWW-Authenticate": challenge}, path=path)(scope, receive, send)
