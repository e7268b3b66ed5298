"""OpenAI error envelope and the mapping from gRPC status codes and validation errors to HTTP.

Contract: every error response from the gateway is
`{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}`, except under
`/v1/messages`, where it is Anthropic's `{"type": "error", "error": {"type": str, "message": str}}`
(same status codes), because the `anthropic` client parses only that shape.
Bad input is always a 4xx (never a 5xx); a 5xx never carries a traceback or core's internal
details, because those can name files, sockets and hosts the client has no business seeing.
Messages of 4xx statuses coming from core are passed through: core writes them for the client
("model 'x' is not served", "prompt is longer than the context").
"""

from __future__ import annotations

import re
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.common.grpc_util import CORE_NOT_SERVING

ERROR_TYPE_BY_HTTP_STATUS: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}

# (HTTP status, whether core's details may be shown to the client)
_HTTP_BY_GRPC_CODE: dict[grpc.StatusCode, tuple[int, bool]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, True),
    grpc.StatusCode.FAILED_PRECONDITION: (400, True),
    grpc.StatusCode.OUT_OF_RANGE: (400, True),
    grpc.StatusCode.NOT_FOUND: (404, True),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, True),
    grpc.StatusCode.UNAUTHENTICATED: (401, True),
    grpc.StatusCode.PERMISSION_DENIED: (403, True),
    grpc.StatusCode.UNAVAILABLE: (503, False),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, False),
    grpc.StatusCode.CANCELLED: (503, False),
}

ANTHROPIC_ERROR_TYPE_BY_HTTP_STATUS: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}
ANTHROPIC_PATH_PREFIX = "/v1/messages"
# Core writes this prefix on the INVALID_ARGUMENT it sends when prompt + max_tokens do not fit.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"

_SAFE_MESSAGE_BY_HTTP_STATUS: dict[int, str] = {
    500: "internal error while generating; the request id in X-Request-Id names it in the logs",
    503: "the model server (core) is unavailable; retry later",
    504: "the model server (core) did not answer within the deadline",
}


class OpenAIError(Exception):
    """An error that becomes an OpenAI error response with `status`."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @property
    def type(self) -> str:
        return ERROR_TYPE_BY_HTTP_STATUS.get(
            self.status, "server_error" if self.status >= 500 else "invalid_request_error"
        )

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        kind = ANTHROPIC_ERROR_TYPE_BY_HTTP_STATUS.get(self.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, headers: dict[str, str] | None = None, *, path: str = "") -> JSONResponse:
        """The error as an HTTP response, in the shape the API under `path` uses."""
        body = self.anthropic_body() if path.startswith(ANTHROPIC_PATH_PREFIX) else self.body()
        return JSONResponse(body, status_code=self.status, headers=headers)


# Core names the GenerateRequest field it refuses first ("sampling: logit_bias: ...",
# "chat.tools[1].name: ..."); the client knows the API's names for them.
_CORE_PATH = re.compile(r"[a-z_][a-z0-9_]*(?:\[\d+\])?(?:\.[a-z_][a-z0-9_]*(?:\[\d+\])?)*")
_PARAM_BY_CORE_PREFIX = (
    ("chat.template_kwargs_json", "chat_template_kwargs"),
    ("chat.", ""),
    ("sampling.", ""),
    ("stopping.", ""),
    ("response_format.schema_json", "response_format.json_schema.schema"),
    ("tool_choice.function_name", "tool_choice.function.name"),
    ("token_ids", "prompt"),
)


# A core field path inside a message's text ("... in chat.tools").
_CORE_PATH_IN_TEXT = re.compile(
    r"\b(?:chat|response_format|tool_choice)\.[a-z_][a-z0-9_]*(?:\[\d+\])?(?:\.[a-z_][a-z0-9_]*(?:\[\d+\])?)*"
)


def _api_param(path: str) -> str:
    for prefix, replacement in _PARAM_BY_CORE_PREFIX:
        if path.startswith(prefix):
            return replacement + path[len(prefix) :]
    return path


def api_names(details: str) -> str:
    """A core message with its GenerateRequest field paths written as the API's parameters."""
    return _CORE_PATH_IN_TEXT.sub(lambda match: _api_param(match.group(0)), details)


def param_from_core_details(details: str) -> str | None:
    """The API parameter a core INVALID_ARGUMENT message names, or None."""
    parts = details.split(": ")
    if len(parts) < 2 or not _CORE_PATH.fullmatch(parts[0]):
        return None
    path = parts[0]
    if path in ("sampling", "stopping") and len(parts) > 2 and _CORE_PATH.fullmatch(parts[1]):
        path = parts[1]
    path = _api_param(path)
    return None if path in ("input", "sampling", "stopping") else path or None


def error_from_grpc(
    error: grpc.aio.AioRpcError | grpc.RpcError, prompt_param: str = "messages"
) -> OpenAIError:
    """Map a failed core call to the HTTP error the client sees (see the module docstring).
    `prompt_param`: the request's prompt field ("messages" for chats, "prompt" for completions)."""
    code: grpc.StatusCode = (
        error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN
    )
    status, show_details = _HTTP_BY_GRPC_CODE.get(code, (500, False))
    details = (error.details() or "") if callable(getattr(error, "details", None)) else ""
    if (show_details or details.startswith(CORE_NOT_SERVING)) and details:
        # core's own reason it cannot serve names the missing layers and workers
        message = api_names(details) if status == 400 else details
    else:
        message = _SAFE_MESSAGE_BY_HTTP_STATUS.get(status, f"request failed ({code.name.lower()})")
    if status == 400 and details.startswith(CONTEXT_LENGTH_EXCEEDED):
        return OpenAIError(status, message, param=prompt_param, code=CONTEXT_LENGTH_EXCEEDED)
    if code == grpc.StatusCode.NOT_FOUND and details.startswith("model "):  # core's check_model
        return OpenAIError(status, message, param="model", code="model_not_found")  # OpenAI's names
    param = param_from_core_details(details) if status == 400 else None
    return OpenAIError(status, message, param=param, code=code.name.lower())


# pydantic adds union-member tags ("str", "list[...]", "function-after[...]", class names) to error
# locations; the client only wants the path of field names and indices.
_FIELD_NAME = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list", "bytes"})


def param_from_location(location: tuple[Any, ...]) -> str | None:
    """`("body", "messages", 0, "role")` → `"messages[0].role"`; None for the body as a whole.

    A tagged union (content parts, response_format, tool_choice) puts its tag before the member's
    fields, and OpenAI's tags are the names of the fields they select (`{"type": "text", "text":
    ...}`), so a name right after itself is the tag: `content[0].text.text` is `content[0].text`."""
    param, previous = "", None
    for part in location[1:] if location and location[0] == "body" else location:
        if isinstance(part, int):
            param += f"[{part}]"
        elif isinstance(part, str) and _FIELD_NAME.fullmatch(part) and part not in _TYPE_TAGS:
            if part != previous:
                param += f".{part}" if param else part
        else:
            continue
        previous = part
    return param or None


def error_from_validation(exc: RequestValidationError, content_type: str | None = None) -> OpenAIError:
    """422 from FastAPI → 400 naming the most specific failing field. `content_type`: the
    request's, named when a body that is not read as JSON is the whole problem."""
    errors = list(exc.errors())
    if not errors:
        return OpenAIError(400, "invalid request body")
    if any(e.get("type") == "json_invalid" for e in errors):
        return OpenAIError(400, "request body is not valid JSON", code="invalid_json")
    # Union members each report an error; the deepest location is the one that explains the input.
    error = max(errors, key=lambda e: len(e.get("loc", ())))
    param = param_from_location(tuple(error.get("loc", ())))
    message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    if param is None and error.get("type") in ("missing", "model_attributes_type", "dict_type"):
        message = "request body must be a JSON object"
        if content_type and not _is_json(content_type):
            # curl -d without -H sends form encoding; FastAPI then reads no JSON at all
            message += f", sent as Content-Type: application/json (this request said {content_type!r})"
    elif error.get("type") == "missing":
        message = "field required"
    elif error.get("type") == "union_tag_invalid":  # e.g. a content part type we do not serve yet
        context = error.get("ctx", {})
        message = f"unsupported type {context.get('tag')!r}; supported: {context.get('expected_tags')}"
    return OpenAIError(400, f"{param}: {message}" if param else message, param=param, code="invalid_value")


async def _openai_error_handler(request: Request, exc: OpenAIError) -> JSONResponse:
    return exc.response(path=request.url.path)


def _is_json(content_type: str) -> bool:
    media = content_type.split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def _validation_error_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    content_type = request.headers.get("content-type")
    return error_from_validation(exc, content_type).response(path=request.url.path)


class CodedHTTPException(StarletteHTTPException):
    """An HTTPException that keeps its OpenAI error `code` (FastAPI re-raises HTTPExceptions from
    body parsing; anything else raised there becomes a generic 400)."""

    def __init__(self, error: OpenAIError, headers: dict[str, str] | None = None) -> None:
        super().__init__(error.status, error.message, headers=headers)
        self.code = error.code


async def _http_error_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return OpenAIError(exc.status_code, str(exc.detail), code=getattr(exc, "code", None)).response(
        headers=dict(exc.headers or {}), path=request.url.path
    )


async def _grpc_error_handler(request: Request, exc: grpc.RpcError) -> JSONResponse:
    return error_from_grpc(exc).response(path=request.url.path)


def internal_error() -> OpenAIError:
    """The 500 for a bug in the gateway: the traceback goes to the log, never to the client."""
    return OpenAIError(500, _SAFE_MESSAGE_BY_HTTP_STATUS[500])


def install_error_handlers(app: FastAPI) -> None:
    """Make the expected error paths of `app` answer with the OpenAI envelope.

    Unexpected exceptions are turned into `internal_error()` by the request-id middleware, which
    sits outside these handlers and can still attach the X-Request-Id header.
    """
    app.add_exception_handler(OpenAIError, _openai_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
    app.add_exception_handler(grpc.RpcError, _grpc_error_handler)
