"""Optional API keys for the `/v1/*` routes.

Contract: with no keys configured (the default) every request passes. With keys, a `/v1/*` request
must present one as `Authorization: Bearer <key>` (OpenAI clients) or `x-api-key: <key>` (Anthropic
clients), else 401 in the API's error shape. Keys are compared with `hmac.compare_digest` against
every configured key, without stopping at the first match, so response time does not reveal how
much of a key was right. `/health`, `/ready`, `/metrics` and `/openapi.json` stay open: probes and
scrapers run inside the trust boundary, as with vLLM's `--api-key`.

Keys come from `--api-key` flags, an `--api-key-file` (one key per line, `#` comments), and the
`MOE_MESH_API_KEY` environment variable (comma-separated), all merged.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable
from pathlib import Path

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from services.gateway.errors import OpenAIError

API_KEY_ENV = "MOE_MESH_API_KEY"
PROTECTED_PREFIX = "/v1/"


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
    from_environment = bool(environment.get(API_KEY_ENV, "").strip())  # set but empty: not asked
    if (keys or key_file is not None or from_environment) and not found:
        sources = [f"--api-key-file {key_file}" if key_file is not None else "", "--api-key" if keys else ""]
        sources.append(API_KEY_ENV if from_environment else "")
        raise ValueError(f"API keys were asked for ({', '.join(s for s in sources if s)}) but none is set")
    return found


def presented_key(headers: Headers) -> str:
    authorization = headers.get("authorization", "")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get("x-api-key", "").strip()


def key_matches(presented: str, keys: tuple[str, ...]) -> bool:
    matched = False
    for key in keys:  # no early exit: every key is compared every time
        matched |= hmac.compare_digest(presented.encode(), key.encode())
    return matched


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: tuple[str, ...]) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not self.keys or not path.startswith(PROTECTED_PREFIX):
            await self.app(scope, receive, send)
            return
        presented = presented_key(Headers(scope=scope))
        if presented and key_matches(presented, self.keys):
            await self.app(scope, receive, send)
            return
        message = "invalid API key" if presented else "missing API key (send Authorization: Bearer <key>)"
        error = OpenAIError(401, message, code="invalid_api_key")
        await error.response({"WWW-Authenticate": "Bearer"}, path=path)(scope, receive, send)
