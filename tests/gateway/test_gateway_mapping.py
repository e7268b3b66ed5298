"""Socket-free tests of the pure mappings: request → GenerateRequest, errors, chunks → OpenAI JSON."""

from __future__ import annotations

import json

import grpc
import pytest
from pydantic import ValidationError

from services.gateway.chat_format import ChatFormatter
from services.gateway.errors import error_from_grpc, param_from_location
from services.gateway.generate_mapping import build_chat_request as build_generate_request
from services.gateway.generation_state import CompletionMeta
from services.gateway.openai_schema import ChatCompletionRequest
from services.proto.moemesh.v1 import core_pb2

USER = [{"role": "user", "content": "Hi"}]


def request(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **fields})


def test_extensions_and_edge_values_map_to_core() -> None:
    sent = build_generate_request(
        request(
            seed=-1,
            top_k=-1,
            stop="END",
            stop_token_ids=[7],
            ignore_eos=True,
            chat_template_kwargs={"enable_thinking": False},
            max_tokens=5,
            max_completion_tokens=9,
            kv_cache="turboquant",
        ),
        "rid-1",
    )
    assert sent.request_id == "rid-1"
    assert sent.sampling.seed == 2**64 - 1  # signed OpenAI seed → core's uint64
    assert not sent.sampling.HasField("top_k")  # -1 means disabled
    assert list(sent.stopping.stop) == ["END"]
    assert list(sent.stopping.stop_token_ids) == [7] and sent.stopping.ignore_eos
    assert sent.stopping.max_tokens == 9  # max_completion_tokens wins over the deprecated max_tokens
    assert json.loads(sent.chat.template_kwargs_json) == {"enable_thinking": False}
    assert sent.model == ""  # core chooses its served model
    assert sent.kv_cache == "turboquant"


def test_the_speculative_switch_reaches_core_only_when_sent() -> None:
    from services.gateway.anthropic_mapping import build_messages_request
    from services.gateway.anthropic_schema import MessagesRequest
    from services.gateway.completions_schema import CompletionRequest
    from services.gateway.generate_mapping import build_completion_request

    assert not build_generate_request(request(), "r").HasField("speculative")
    sent = build_generate_request(request(speculative=False), "r")
    assert sent.HasField("speculative") and sent.speculative is False
    completion = CompletionRequest.model_validate({"prompt": "a", "speculative": False})
    assert build_completion_request(completion, "r").HasField("speculative")
    message = MessagesRequest.model_validate(
        {"model": "m", "max_tokens": 4, "messages": USER, "speculative": False}
    )
    built = build_messages_request(message, "r")
    assert built.HasField("speculative") and not built.speculative
    with pytest.raises(ValidationError):
        request(speculative="no")  # a switch, not a string


def test_content_parts_are_joined() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    sent = build_generate_request(request(messages=[{"role": "user", "content": parts}]), "r")
    assert sent.chat.messages[0].content == "ab"


def test_unknown_fields_are_ignored() -> None:
    assert request(parallel_tool_calls=True, metadata={"a": 1}, store=False).n == 1


@pytest.mark.parametrize(
    "fields",
    [
        {"n": 0},
        {"top_p": 0},
        {"seed": 2**64},
        {"messages": []},
        {"tool_choice": {"type": "function", "function": {"name": "f"}}},
        {"tool_choice": "required"},
        {"logit_bias": {"a": 1}},
        {"stop": ""},
        {"response_format": {"type": "xml"}},
    ],
)
def test_schema_refuses(fields: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        request(**fields)


@pytest.mark.parametrize(
    ("location", "param"),
    [
        (("body", "messages", 0, "role"), "messages[0].role"),
        (
            ("body", "messages", 1, "content", "list[tagged-union[TextContentPart]]", 0),
            "messages[1].content[0]",
        ),
        (("body", "stop", "str"), "stop"),
        (("body", "tool_choice", "literal['none','auto','required']"), "tool_choice"),
        (("body",), None),
    ],
)
def test_param_from_location(location: tuple[object, ...], param: str | None) -> None:
    assert param_from_location(location) == param


@pytest.mark.parametrize(
    ("details", "param"),
    [
        ("sampling: logit_bias: token id 99999999 is outside the vocabulary", "logit_bias"),
        ("logit_bias: token id 151936 is outside the vocabulary", "logit_bias"),
        ("stop_token_ids: token id 151941 is outside the vocabulary", "stop_token_ids"),
        ("chat.tools[1].name: 'f' is defined twice", "tools[1].name"),
        ("chat.template_kwargs_json: must be a JSON object", "chat_template_kwargs"),
        ("response_format.schema_json: not valid JSON: oops", "response_format.json_schema.schema"),
        ("tool_choice.function_name: no tool named 'x' in chat.tools", "tool_choice.function.name"),
        ("token_ids: id 5 is outside the vocabulary", "prompt"),
        ("kv_cache: unknown kind 'x'", "kv_cache"),
        ("input: one of chat, prompt, token_ids is required", None),
        ("the prompt is empty", None),
    ],
)
def test_core_errors_name_the_api_parameter(details: str, param: str | None) -> None:
    error = error_from_grpc(FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, details))
    assert (error.status, error.param) == (400, param)


@pytest.mark.parametrize(
    ("details", "message"),
    [
        (
            "tool_choice: required needs at least one tool in chat.tools",
            "tool_choice: required needs at least one tool in tools",
        ),
        ("chat.tools: this model has no tool-call format", "tools: this model has no tool-call format"),
        (
            "tool_choice.function_name: no tool named 'x' in chat.tools",
            "tool_choice.function.name: no tool named 'x' in tools",
        ),
        ("chat.template_kwargs_json: must be a JSON object", "chat_template_kwargs: must be a JSON object"),
        ("chat.tools[1].name: 'f' is defined twice", "tools[1].name: 'f' is defined twice"),
        (
            "logit_bias: token id 151936 is outside the vocabulary",
            "logit_bias: token id 151936 is outside the vocabulary",
        ),
    ],
)
def test_core_errors_speak_of_the_apis_parameters(details: str, message: str) -> None:
    error = error_from_grpc(FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, details))
    assert error.message == message


def test_context_length_names_the_routes_prompt_field() -> None:
    details = "context_length_exceeded: the prompt has 9 tokens"
    for prompt_param in ("messages", "prompt"):
        error = error_from_grpc(FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, details), prompt_param)
        assert (error.param, error.code) == (prompt_param, "context_length_exceeded")


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def test_grpc_error_mapping_hides_internal_details() -> None:
    hidden = error_from_grpc(FakeRpcError(grpc.StatusCode.INTERNAL, "Traceback ... /srv/core.py"))
    assert hidden.status == 500 and "Traceback" not in hidden.message
    shown = error_from_grpc(FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full (64 waiting)"))
    assert (shown.status, shown.type, shown.message) == (429, "rate_limit_error", "queue full (64 waiting)")
    assert shown.body() == {
        "error": {
            "message": "queue full (64 waiting)",
            "type": "rate_limit_error",
            "param": None,
            "code": "resource_exhausted",
        }
    }


def frames(raw: list[bytes]) -> list[dict]:
    return [
        json.loads(line.removeprefix(b"data: ")) for frame in raw for line in frame.split(b"\n\n") if line
    ]


def test_finish_chunk_with_text_gives_delta_then_finish() -> None:
    formatter = ChatFormatter(
        CompletionMeta(id="chatcmpl-x", created=1, model="m"), include_usage=False, with_logprobs=False
    )
    last = core_pb2.GenerateChunk(
        text="end",
        token_ids=[1, 2],
        finish_reason=core_pb2.LENGTH,
        usage=core_pb2.Usage(prompt_tokens=4, completion_tokens=2),
    )
    formatter.state.add(last)
    chunks = frames(formatter.on_chunk(last))
    assert [c["choices"][0]["delta"] for c in chunks] == [{"content": "end"}, {}]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "length"]
    assert "usage" not in chunks[0]
    assert formatter.result()["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 2,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_usage_falls_back_to_counted_tokens() -> None:
    formatter = ChatFormatter(CompletionMeta("chatcmpl-y", 1, "m"), include_usage=False, with_logprobs=False)
    formatter.state.add(core_pb2.GenerateChunk(text="a", token_ids=[1]))
    formatter.state.add(core_pb2.GenerateChunk(text="b", token_ids=[2, 3], finish_reason=core_pb2.STOP))
    completion = formatter.result()
    assert completion["usage"]["completion_tokens"] == 3
    assert completion["choices"][0]["message"] == {"role": "assistant", "content": "ab"}
