"""The gateway over raw HTTP: error envelopes, status mapping, models, health, request ids."""

from __future__ import annotations

import json
from typing import Any

import grpc
import httpx
import pytest

from services.proto.moemesh.v1 import core_pb2

from .conftest import GatewayThread
from .core_double import MODEL_ID, CoreDouble

CHAT = "/v1/chat/completions"
VALID_BODY: dict[str, Any] = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}]}


def assert_envelope(response: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL_ID}, "messages"),
        ({**VALID_BODY, "messages": []}, "messages"),
        ({**VALID_BODY, "n": 0}, "n"),
        ({**VALID_BODY, "n": 257}, "n"),
        ({**VALID_BODY, "messages": [{"role": "wizard", "content": "Hi"}]}, "messages[0].role"),
        (
            {
                **VALID_BODY,
                "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
            },
            "messages[0].content[0]",
        ),
        (  # the union's tag ("text") is not repeated in the path
            {**VALID_BODY, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages[0].content[0].text",
        ),
        (
            {
                **VALID_BODY,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": True}},
            },
            "response_format.json_schema.schema",
        ),
        ({**VALID_BODY, "temperature": 5}, "temperature"),
        ({**VALID_BODY, "max_tokens": 0}, "max_tokens"),
        ({**VALID_BODY, "stop": 3}, "stop"),
        ({**VALID_BODY, "tool_choice": "required"}, "tool_choice"),
        ({**VALID_BODY, "top_logprobs": 2}, "top_logprobs"),
        ([VALID_BODY], None),
        ({**VALID_BODY, "messages": [{"role": "user"}]}, "messages[0]"),
        ({**VALID_BODY, "messages": [{"role": "user", "content": None}]}, "messages[0]"),
        (
            {**VALID_BODY, "messages": [*VALID_BODY["messages"], {"role": "tool", "content": "4"}]},
            "messages[1]",
        ),
        ({**VALID_BODY, "stream": "yes"}, "stream"),  # no lax coercion of strings into booleans
        ({**VALID_BODY, "stream_options": {"include_usage": True}}, "stream_options"),
        (  # a tool's arguments are an object, so its schema must be one's
            {
                **VALID_BODY,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
            },
            "tools[0].function.parameters",
        ),
    ],
)
def test_invalid_requests_are_400_naming_the_field(gateway_url: str, core: CoreDouble, body, param) -> None:
    response = httpx.post(gateway_url + CHAT, json=body)
    error = assert_envelope(response, 400, param)
    assert error["type"] == "invalid_request_error"
    assert core.requests == []  # refused before core is asked


def test_a_json_body_sent_as_a_form_is_told_what_content_type_to_send(
    gateway_url: str, core: CoreDouble
) -> None:
    """`curl -d '{...}'` without -H sends application/x-www-form-urlencoded, which FastAPI does not
    read as JSON: the error says so instead of calling a JSON object not one."""
    import json

    for route in (CHAT, "/v1/completions", "/v1/messages"):
        response = httpx.post(
            gateway_url + route,
            content=json.dumps(VALID_BODY),
            headers={"content-type": "application/x-www-form-urlencoded"},
        )
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert "Content-Type: application/json" in message and "x-www-form-urlencoded" in message, message
    plain = httpx.post(gateway_url + CHAT, json=[VALID_BODY])  # JSON, just not an object
    assert plain.json()["error"]["message"] == "request body must be a JSON object"
    assert core.requests == []


def test_too_many_choices_are_refused_clearly(gateway_url: str, core: CoreDouble) -> None:
    error = assert_envelope(httpx.post(gateway_url + CHAT, json={**VALID_BODY, "n": 300}), 400, "n")
    assert "256" in error["message"]
    assert core.requests == []


LONE_SURROGATE = "a\\ud800b"  # valid JSON; decodes to a str no UTF-8 encoder takes


@pytest.mark.parametrize(
    ("route", "raw", "where"),
    [
        (CHAT, f'{{"messages":[{{"role":"user","content":"{LONE_SURROGATE}"}}]}}', "messages"),
        (CHAT, f'{{"messages":[{{"role":"user","content":"Hi"}}],"stop":["{LONE_SURROGATE}"]}}', "stop"),
        (CHAT, f'{{"model":"{LONE_SURROGATE}","messages":[{{"role":"user","content":"Hi"}}]}}', "model"),
        ("/v1/completions", f'{{"prompt":"{LONE_SURROGATE}"}}', "prompt"),
        (
            "/v1/messages",
            f'{{"max_tokens":4,"messages":[{{"role":"user","content":"{LONE_SURROGATE}"}}]}}',
            "messages",
        ),
        (
            "/v1/messages/count_tokens",
            f'{{"messages":[{{"role":"user","content":"{LONE_SURROGATE}"}}]}}',
            "messages",
        ),
    ],
)
def test_a_lone_surrogate_is_a_400_not_a_500(gateway_url: str, core: CoreDouble, route, raw, where) -> None:
    response = httpx.post(
        gateway_url + route, content=raw.encode(), headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400, response.text
    body = response.json()
    message = body["error"]["message"]
    assert "surrogate" in message and where in json.dumps(body)
    assert core.requests == []


@pytest.mark.parametrize("raw", [b"{not json", b"", b'{"model": "x", "messages": [', "ü".encode("latin-1")])
def test_malformed_json_is_400(gateway_url: str, core: CoreDouble, raw: bytes) -> None:
    response = httpx.post(gateway_url + CHAT, content=raw, headers={"Content-Type": "application/json"})
    assert_envelope(response, 400)


def test_unknown_route_and_method_use_envelope(gateway_url: str, core: CoreDouble) -> None:
    assert_envelope(httpx.get(gateway_url + "/v1/nope"), 404)
    assert_envelope(httpx.get(gateway_url + CHAT), 405)


def test_body_size_cap(core_server) -> None:
    gateway = GatewayThread(core_server.target, max_body_bytes=1000).start()
    try:
        big = {**VALID_BODY, "messages": [{"role": "user", "content": "x" * 2000}]}
        declared = assert_envelope(httpx.post(gateway.url + CHAT, json=big), 413)

        def chunked():  # no Content-Length: the cap is enforced while reading
            yield json.dumps(big).encode()

        streamed = assert_envelope(
            httpx.post(gateway.url + CHAT, content=chunked(), headers={"Content-Type": "application/json"}),
            413,
        )
        assert declared == streamed  # one refusal, whichever way the size was found out
        assert declared["code"] == "body_too_large"
    finally:
        gateway.stop()


STATUS_MAPPING = [
    (grpc.StatusCode.INVALID_ARGUMENT, 400),
    (grpc.StatusCode.FAILED_PRECONDITION, 400),
    (grpc.StatusCode.OUT_OF_RANGE, 400),
    (grpc.StatusCode.NOT_FOUND, 404),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    (grpc.StatusCode.UNAUTHENTICATED, 401),
    (grpc.StatusCode.UNAVAILABLE, 503),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
    (grpc.StatusCode.INTERNAL, 500),
    (grpc.StatusCode.UNKNOWN, 500),
    (grpc.StatusCode.DATA_LOSS, 500),
]


@pytest.mark.parametrize(("code", "status"), STATUS_MAPPING)
@pytest.mark.parametrize("stream", [False, True])
def test_core_status_mapping(gateway_url: str, core: CoreDouble, code, status: int, stream: bool) -> None:
    core.script.abort_code = code
    core.script.abort_message = f"core says {code.name}"
    response = httpx.post(gateway_url + CHAT, json={**VALID_BODY, "stream": stream})
    error = assert_envelope(response, status)
    assert error["code"] == code.name.lower()
    if status < 500:
        assert error["message"] == f"core says {code.name}"  # core's client-facing message
    else:
        assert "core says" not in error["message"]  # internal details stay in the logs


def test_mid_stream_error_event_ends_stream(gateway_url: str, core: CoreDouble) -> None:
    core.script.abort_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    core.script.abort_after_chunks = 3
    with httpx.stream("POST", gateway_url + CHAT, json={**VALID_BODY, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert "[DONE]" not in events
    last = json.loads(events[-1])
    assert last["error"]["code"] == "resource_exhausted" and last["error"]["type"] == "rate_limit_error"
    assert sum(1 for e in events[:-1] if json.loads(e)["choices"][0]["delta"].get("content")) == 3


def test_missing_finish_reason_is_500_not_a_guess(gateway_url: str, core: CoreDouble) -> None:
    core.script.send_finish_chunk = False
    assert_envelope(httpx.post(gateway_url + CHAT, json=VALID_BODY), 500)


def test_sse_framing(gateway_url: str, core: CoreDouble) -> None:
    body = {**VALID_BODY, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", gateway_url + CHAT, json=body) as response:
        raw = response.read().decode()
    frames = raw.split("\n\n")
    assert frames[-1] == "" and frames[-2] == "data: [DONE]"
    assert all(frame.startswith("data: ") for frame in frames[:-1])
    first = json.loads(frames[0].removeprefix("data: "))
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert json.loads(frames[-3].removeprefix("data: "))["usage"]["total_tokens"] == 1 + 7


def test_models(gateway_url: str, core: CoreDouble) -> None:
    response = httpx.get(gateway_url + "/v1/models")
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "list"
    assert body["data"] == [
        {
            "id": MODEL_ID,
            "object": "model",
            "created": 1_700_000_000,
            "owned_by": "moe-mesh",
            "max_model_len": 2048,
            "type": "model",
            "display_name": MODEL_ID,
            "created_at": "2023-11-14T22:13:20Z",
        }
    ]


def test_version_is_the_installed_one(gateway_url: str) -> None:
    from importlib import metadata

    installed = metadata.version("moe-mesh")
    assert httpx.get(gateway_url + "/version").json() == {"version": installed}
    assert httpx.get(gateway_url + "/openapi.json").json()["info"]["version"] == installed


def test_health_reports_core_status(gateway_url: str, core_server, core: CoreDouble) -> None:
    assert httpx.get(gateway_url + "/health").json() == {"status": "ok", "core": "SERVING"}
    core_server.set_serving(False)
    response = httpx.get(gateway_url + "/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "core": "NOT_SERVING"}


def test_gateway_without_core(tmp_path) -> None:
    gateway = GatewayThread(f"unix://{tmp_path}/absent.sock", unary_timeout_s=1.0).start()
    try:
        health = httpx.get(gateway.url + "/health")
        assert health.status_code == 200 and health.json() == {"status": "ok", "core": "UNREACHABLE"}
        error = assert_envelope(httpx.post(gateway.url + CHAT, json=VALID_BODY), 503)
        assert "absent.sock" not in error["message"]
        assert_envelope(httpx.get(gateway.url + "/v1/models"), 503)
    finally:
        gateway.stop()


def test_request_id_round_trip(gateway_url: str, core: CoreDouble) -> None:
    response = httpx.post(gateway_url + CHAT, json=VALID_BODY, headers={"X-Request-Id": "trace-42.a"})
    assert response.headers["x-request-id"] == "trace-42.a"
    assert response.json()["id"] == "chatcmpl-trace-42.a"
    assert core.metadata[0]["x-request-id"] == "trace-42.a"
    assert core.requests[0].request_id == "trace-42.a"


def test_request_id_generated_and_unsafe_ones_replaced(gateway_url: str, core: CoreDouble) -> None:
    generated = httpx.post(gateway_url + CHAT, json=VALID_BODY).headers["x-request-id"]
    replaced = httpx.post(
        gateway_url + CHAT, json=VALID_BODY, headers={"X-Request-Id": "bad id\twith spaces"}
    ).headers["x-request-id"]
    for request_id, metadata in zip([generated, replaced], core.metadata, strict=True):
        assert len(request_id) == 32 and metadata["x-request-id"] == request_id
    error_response = httpx.post(gateway_url + CHAT, content=b"{")
    assert error_response.headers["x-request-id"]


def test_deadline_becomes_504(core_server, core: CoreDouble) -> None:
    core.script.delay_before_first_s = 2.0
    gateway = GatewayThread(core_server.target, generate_timeout_s=0.3).start()
    try:
        error = assert_envelope(httpx.post(gateway.url + CHAT, json=VALID_BODY), 504)
        assert error["type"] == "timeout_error"
    finally:
        gateway.stop()
    assert core.cancelled.wait(5)  # the deadline also ends the call on core's side


def test_finish_reason_cancelled_maps_to_abort(gateway_url: str, core: CoreDouble) -> None:
    core.script.finish_reason = core_pb2.CANCELLED
    assert httpx.post(gateway_url + CHAT, json=VALID_BODY).json()["choices"][0]["finish_reason"] == "abort"
