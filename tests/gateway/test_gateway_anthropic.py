"""`/v1/messages` as the official `anthropic` client sees it, against the Core double."""

from __future__ import annotations

import json

import anthropic
import grpc
import httpx
import pytest

from services.proto.moemesh.v1 import core_pb2

from .core_double import ANSWER, ANSWER_WORDS, MODEL_ID, CoreDouble

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "name": "get_weather",
    "description": "Current weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=30)


def test_create(gateway_url: str, core: CoreDouble) -> None:
    message = client(gateway_url).messages.create(
        model=MODEL_ID, max_tokens=64, system="Answer briefly.", messages=QUESTION, stop_sequences=["\n\n"]
    )
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL_ID
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == ANSWER
    assert message.stop_reason == "end_turn"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (2 + 6, 7)
    sent = core.requests[0]
    assert [(m.role, m.content) for m in sent.chat.messages] == [
        ("system", "Answer briefly."),
        ("user", "What is the capital of France?"),
    ]
    assert sent.stopping.max_tokens == 64 and list(sent.stopping.stop) == ["\n\n"]


def test_cached_prompt_tokens_are_reported_apart_from_input_tokens(
    gateway_url: str, core: CoreDouble
) -> None:
    """Anthropic's input counters are disjoint: input_tokens + cache_read_input_tokens is the prompt
    (clients sum them for context meters and costs)."""
    core.script.cached_prompt_tokens = 5
    whole = client(gateway_url).messages.create(model=MODEL_ID, max_tokens=64, messages=QUESTION)
    with client(gateway_url).messages.stream(model=MODEL_ID, max_tokens=64, messages=QUESTION) as stream:
        final = stream.get_final_message()  # (message_start's counts: test_gateway_live, real core)
    for usage in (whole.usage, final.usage):
        assert (usage.input_tokens, usage.cache_read_input_tokens) == (6 - 5, 5)
        assert usage.cache_creation_input_tokens == 0


def test_max_tokens_stop_reason(gateway_url: str, core: CoreDouble) -> None:
    message = client(gateway_url).messages.create(model=MODEL_ID, max_tokens=2, messages=QUESTION)
    assert message.stop_reason == "max_tokens" and message.content[0].text == "The capital"


def test_stream_event_sequence_and_text(gateway_url: str, core: CoreDouble) -> None:
    events: list[str] = []
    with client(gateway_url).messages.stream(model=MODEL_ID, max_tokens=64, messages=QUESTION) as stream:
        for event in stream:
            events.append(event.type)
        final = stream.get_final_message()
    assert final.content[0].text == ANSWER and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == 7 and final.usage.input_tokens == 6
    raw = [name for name in events if name not in ("text",)]  # "text" is the helper's own event
    assert raw == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * len(ANSWER_WORDS),
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]


def test_raw_stream_frames_name_their_events(gateway_url: str, core: CoreDouble) -> None:
    body = {"model": MODEL_ID, "max_tokens": 8, "messages": QUESTION, "stream": True}
    with httpx.stream("POST", gateway_url + "/v1/messages", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    payloads = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert names == [payload["type"] for payload in payloads]  # every frame's name matches its type
    assert names[0] == "message_start" and names[-1] == "message_stop"


def test_tool_use_round_trip(gateway_url: str, core: CoreDouble) -> None:
    core.script.words = ["Let me check."]
    core.script.finish_reason = core_pb2.TOOL_CALLS
    core.script.tool_calls = [
        core_pb2.ToolCall(id="toolu_1", name="get_weather", arguments='{"city": "Paris"}')
    ]
    history = [
        *QUESTION,
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_0", "name": "get_weather", "input": {"city": "Lyon"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_0", "content": "12 C"},
                {"type": "text", "text": "And Paris?"},
            ],
        },
    ]
    message = client(gateway_url).messages.create(
        model=MODEL_ID, max_tokens=64, messages=history, tools=[WEATHER], tool_choice={"type": "auto"}
    )
    assert message.stop_reason == "tool_use"
    assert [block.type for block in message.content] == ["text", "tool_use"]
    tool_use = message.content[1]
    assert (tool_use.id, tool_use.name, tool_use.input) == ("toolu_1", "get_weather", {"city": "Paris"})
    sent = core.requests[0].chat
    assert [(m.role, m.content, m.tool_call_id) for m in sent.messages] == [
        ("user", "What is the capital of France?", ""),
        ("assistant", "Checking.", ""),
        ("tool", "12 C", "toolu_0"),
        ("user", "And Paris?", ""),
    ]
    assert json.loads(sent.messages[1].tool_calls[0].arguments) == {"city": "Lyon"}
    assert (
        sent.tools[0].name == "get_weather"
        and json.loads(sent.tools[0].parameters_json) == WEATHER["input_schema"]
    )

    with client(gateway_url).messages.stream(
        model=MODEL_ID, max_tokens=64, messages=history, tools=[WEATHER]
    ) as stream:
        final = stream.get_final_message()
    assert [block.type for block in final.content] == ["text", "tool_use"]
    assert final.content[1].input == {"city": "Paris"} and final.stop_reason == "tool_use"


@pytest.mark.parametrize(
    ("choice", "mode", "name"),
    [
        ({"type": "any"}, core_pb2.ToolChoice.REQUIRED, ""),
        ({"type": "tool", "name": "get_weather"}, core_pb2.ToolChoice.NAMED, "get_weather"),
        ({"type": "none"}, core_pb2.ToolChoice.NONE, ""),
    ],
)
def test_tool_choice_maps(gateway_url: str, core: CoreDouble, choice, mode, name) -> None:
    client(gateway_url).messages.create(
        model=MODEL_ID, max_tokens=8, messages=QUESTION, tools=[WEATHER], tool_choice=choice
    )
    sent = core.requests[0].chat
    assert (sent.tool_choice.mode, sent.tool_choice.function_name) == (mode, name)
    assert len(sent.tools) == (0 if choice["type"] == "none" else 1)


def test_thinking_blocks(gateway_url: str, core: CoreDouble) -> None:
    core.script.reasoning = ["Paris is", " the capital."]
    kwargs = {
        "model": MODEL_ID,
        "max_tokens": 64,
        "messages": QUESTION,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    }
    message = client(gateway_url).messages.create(**kwargs)
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "Paris is the capital." and message.content[1].text == ANSWER
    assert json.loads(core.requests[0].chat.template_kwargs_json) == {"enable_thinking": True}
    with client(gateway_url).messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [block.type for block in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "Paris is the capital."


def test_errors_are_anthropic_shaped(gateway_url: str, core: CoreDouble) -> None:
    with pytest.raises(anthropic.BadRequestError) as raised:
        client(gateway_url).messages.create(model=MODEL_ID, max_tokens=0, messages=QUESTION)
    assert raised.value.body["type"] == "error"
    assert raised.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in raised.value.body["error"]["message"]
    response = httpx.post(gateway_url + "/v1/messages", json={"model": MODEL_ID, "messages": QUESTION})
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    image = [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": ""}}]}]
    response = httpx.post(
        gateway_url + "/v1/messages", json={"model": MODEL_ID, "max_tokens": 5, "messages": image}
    )
    assert response.status_code == 400 and "image" in response.json()["error"]["message"]
    not_an_object = {**WEATHER, "input_schema": {"type": "array"}}
    response = httpx.post(
        gateway_url + "/v1/messages",
        json={"model": MODEL_ID, "max_tokens": 5, "messages": QUESTION, "tools": [not_an_object]},
    )
    assert response.status_code == 400 and "input_schema" in response.json()["error"]["message"]
    assert core.requests == []
    with pytest.raises(anthropic.NotFoundError) as raised:
        client(gateway_url).messages.create(model="claude-9", max_tokens=5, messages=QUESTION)
    assert raised.value.body["error"]["type"] == "not_found_error"


@pytest.mark.parametrize(
    ("code", "exception", "kind"),
    [
        (grpc.StatusCode.RESOURCE_EXHAUSTED, anthropic.RateLimitError, "rate_limit_error"),
        (grpc.StatusCode.UNAVAILABLE, anthropic.InternalServerError, "overloaded_error"),
    ],
)
def test_core_errors_map(gateway_url: str, core: CoreDouble, code, exception, kind) -> None:
    core.script.abort_code = code
    with pytest.raises(exception) as raised:
        client(gateway_url).messages.create(model=MODEL_ID, max_tokens=5, messages=QUESTION)
    assert raised.value.body["error"]["type"] == kind


def test_error_mid_stream_is_an_error_event(gateway_url: str, core: CoreDouble) -> None:
    core.script.abort_code = grpc.StatusCode.INTERNAL
    core.script.abort_message = "secret /var/run/core.sock detail"
    core.script.abort_after_chunks = 2
    with pytest.raises(anthropic.APIStatusError) as raised:
        with client(gateway_url).messages.stream(model=MODEL_ID, max_tokens=64, messages=QUESTION) as stream:
            for _ in stream:
                pass
    assert "secret" not in str(raised.value)


def test_structured_output_parse(gateway_url: str, core: CoreDouble) -> None:
    from pydantic import BaseModel

    class Answer(BaseModel):
        capital: str

    core.script.words = ['{"capital":', ' "Paris"}']
    parsed = client(gateway_url).messages.parse(
        model=MODEL_ID, max_tokens=32, messages=QUESTION, output_format=Answer
    )
    assert parsed.parsed_output == Answer(capital="Paris")
    sent = core.requests[0].response_format
    assert sent.type == core_pb2.ResponseFormat.JSON_SCHEMA
    assert json.loads(sent.schema_json)["properties"]["capital"]["type"] == "string"


def test_the_beta_output_format_is_the_same_structured_output(gateway_url: str, core: CoreDouble) -> None:
    schema = {"type": "object", "properties": {"capital": {"type": "string"}}, "required": ["capital"]}
    body = {"model": MODEL_ID, "max_tokens": 32, "messages": QUESTION}
    response = httpx.post(
        gateway_url + "/v1/messages",
        json={**body, "output_format": {"type": "json_schema", "schema": schema}},
    )
    assert response.status_code == 200, response.text
    sent = core.requests[0].response_format
    assert sent.type == core_pb2.ResponseFormat.JSON_SCHEMA and json.loads(sent.schema_json) == schema
    both = {
        **body,
        "output_format": {"type": "json_schema", "schema": schema},
        "output_config": {"format": {"type": "json_schema", "schema": schema}},
    }
    response = httpx.post(gateway_url + "/v1/messages", json=both)
    assert response.status_code == 400 and "not both" in response.json()["error"]["message"]
    assert len(core.requests) == 1


@pytest.mark.parametrize(
    ("messages", "says"),
    [
        ([{"role": "user", "content": ""}], "non-empty content"),
        ([{"role": "user", "content": []}], "non-empty content"),
        (
            [{"role": "user", "content": [{"type": "text", "text": ""}]}],
            "text content blocks must be non-empty",
        ),
        (
            [*QUESTION, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": ""}],
            "non-empty content",
        ),
        (
            [
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "1"}],
                }
            ],
            "toolu_9",
        ),
        (
            [
                *QUESTION,
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "toolu_0", "name": "f", "input": {}}],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "1"}],
                },
            ],
            "corresponding `tool_use`",
        ),
    ],
)
def test_messages_anthropic_refuses_are_refused(gateway_url: str, core: CoreDouble, messages, says) -> None:
    """Anthropic answers these with a 400; a template given them would render a turn from nothing
    or a tool result answering no call."""
    for route in ("/v1/messages", "/v1/messages/count_tokens"):
        response = httpx.post(
            gateway_url + route, json={"model": MODEL_ID, "max_tokens": 8, "messages": messages}
        )
        assert response.status_code == 400, (route, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and says in error["message"], error
    assert core.requests == []


def test_an_empty_final_assistant_turn_is_accepted(gateway_url: str, core: CoreDouble) -> None:
    response = httpx.post(
        gateway_url + "/v1/messages",
        json={
            "model": MODEL_ID,
            "max_tokens": 8,
            "messages": [*QUESTION, {"role": "assistant", "content": ""}],
        },
    )
    assert response.status_code == 200, response.text


def test_stop_sequence_is_reported(gateway_url: str, core: CoreDouble) -> None:
    core.script.words = ANSWER_WORDS[:3]
    core.script.matched_stop = " of"
    message = client(gateway_url).messages.create(
        model=MODEL_ID, max_tokens=32, messages=QUESTION, stop_sequences=[" of", "END"]
    )
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", " of")
    with client(gateway_url).messages.stream(
        model=MODEL_ID, max_tokens=32, messages=QUESTION, stop_sequences=[" of"]
    ) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", " of")


def test_count_tokens(gateway_url: str, core: CoreDouble) -> None:
    counted = client(gateway_url).messages.count_tokens(
        model=MODEL_ID, system="Answer briefly.", messages=QUESTION, tools=[WEATHER]
    )
    assert counted.input_tokens == 2 + 6  # the double counts words of the mapped messages
    response = httpx.post(gateway_url + "/v1/messages/count_tokens", json={"model": MODEL_ID, "messages": []})
    assert response.status_code == 400 and response.json()["type"] == "error"


def test_a_final_assistant_turn_is_a_prefill_core_continues(gateway_url: str, core: CoreDouble) -> None:
    prefill = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    client(gateway_url).messages.create(model=MODEL_ID, max_tokens=8, messages=prefill)
    client(gateway_url).messages.create(model=MODEL_ID, max_tokens=8, messages=QUESTION)
    continued, answered = core.requests
    assert continued.chat.continue_final_message and continued.chat.messages[-1].role == "assistant"
    assert not answered.chat.continue_final_message
