"""Chat features through the official `openai` client against the Core double: tool calls streamed
and merged by `chat.completions.stream()`, reasoning_content, response_format, logit_bias,
tool_choice, cached tokens, context-length errors."""

from __future__ import annotations

import json

import grpc
import openai
import pytest
from pydantic import BaseModel

from services.proto.moemesh.v1 import core_pb2

from .core_double import ANSWER, MODEL_ID, CoreDouble
from .test_gateway_openai_client import MESSAGES, async_client, sync_client

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def script_tool_calls(core: CoreDouble, *calls: tuple[str, str, str]) -> None:
    """The chunks core's Qwen3 parser sends for `<tool_call>` blocks: whole calls, then TOOL_CALLS."""
    core.script.words = []
    core.script.finish_reason = core_pb2.TOOL_CALLS
    core.script.tool_calls = [
        core_pb2.ToolCall(id=call_id, name=name, arguments=arguments, index=index)
        for index, (call_id, name, arguments) in enumerate(calls)
    ]


def test_stream_helper_merges_parallel_tool_calls(gateway_url: str, core: CoreDouble) -> None:
    script_tool_calls(
        core,
        ("call_a", "get_weather", '{"city": "Paris", "unit": "c"}'),
        ("call_b", "get_time", '{"timezone": "Europe/Paris"}'),
    )
    client = sync_client(gateway_url)
    events = []
    with client.chat.completions.stream(
        model=MODEL_ID, messages=MESSAGES, tools=[WEATHER_TOOL, TIME_TOOL]
    ) as stream:
        for event in stream:
            events.append(event.type)
        final = stream.get_final_completion()
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls"
    assert [(call.id, call.function.name) for call in message.tool_calls] == [
        ("call_a", "get_weather"),
        ("call_b", "get_time"),
    ]
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris", "unit": "c"}
    assert json.loads(message.tool_calls[1].function.arguments) == {"timezone": "Europe/Paris"}
    assert "tool_calls.function.arguments.done" in events


def test_stream_helper_parses_strict_tool_arguments(gateway_url: str, core: CoreDouble) -> None:
    script_tool_calls(core, ("call_a", "get_weather", '{"city": "Oslo"}'))

    class GetWeather(BaseModel):
        city: str

    with sync_client(gateway_url).chat.completions.stream(
        model=MODEL_ID,
        messages=MESSAGES,
        tools=[openai.pydantic_function_tool(GetWeather, name="get_weather")],
    ) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.parsed_arguments == GetWeather(city="Oslo")


async def test_async_stream_tool_call_deltas(gateway_url: str, core: CoreDouble) -> None:
    script_tool_calls(core, ("call_a", "get_weather", '{"city": "Rome"}'))
    client = async_client(gateway_url)
    arguments, names = "", []
    stream = await client.chat.completions.create(
        model=MODEL_ID, messages=MESSAGES, tools=[WEATHER_TOOL], stream=True
    )
    finish = None
    async for chunk in stream:
        for call in chunk.choices[0].delta.tool_calls or []:
            names += [call.function.name] if call.function.name else []
            arguments += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    await client.close()
    assert names == ["get_weather"] and json.loads(arguments) == {"city": "Rome"} and finish == "tool_calls"


@pytest.mark.parametrize(
    ("choice", "mode", "name"),
    [
        ("auto", core_pb2.ToolChoice.AUTO, ""),
        ("required", core_pb2.ToolChoice.REQUIRED, ""),
        ({"type": "function", "function": {"name": "get_time"}}, core_pb2.ToolChoice.NAMED, "get_time"),
    ],
)
def test_tool_choice_reaches_core(gateway_url: str, core: CoreDouble, choice, mode, name) -> None:
    sync_client(gateway_url).chat.completions.create(
        model=MODEL_ID, messages=MESSAGES, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=choice
    )
    sent = core.requests[0].chat
    assert (sent.tool_choice.mode, sent.tool_choice.function_name) == (mode, name)
    assert [tool.name for tool in sent.tools] == ["get_weather", "get_time"]
    assert json.loads(sent.tools[0].parameters_json) == WEATHER_TOOL["function"]["parameters"]


def test_tool_choice_naming_unknown_tool_is_400(gateway_url: str, core: CoreDouble) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        sync_client(gateway_url).chat.completions.create(
            model=MODEL_ID,
            messages=MESSAGES,
            tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "function": {"name": "launch"}},
        )
    assert raised.value.body["param"] == "tool_choice" and "launch" in raised.value.body["message"]
    assert core.requests == []


def test_reasoning_content_is_separate(gateway_url: str, core: CoreDouble) -> None:
    core.script.reasoning = ["The user asks", " about France."]
    completion = sync_client(gateway_url).chat.completions.create(model=MODEL_ID, messages=MESSAGES)
    message = completion.choices[0].message
    assert message.content == ANSWER
    assert message.reasoning_content == "The user asks about France."  # type: ignore[attr-defined]
    assert completion.usage.completion_tokens == 7 + 2

    stream = sync_client(gateway_url).chat.completions.create(model=MODEL_ID, messages=MESSAGES, stream=True)
    reasoning, content = "", ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
    assert (reasoning, content) == ("The user asks about France.", ANSWER)


def test_response_format_json_schema_reaches_core(gateway_url: str, core: CoreDouble) -> None:
    schema = {"type": "object", "properties": {"capital": {"type": "string"}}, "required": ["capital"]}
    sync_client(gateway_url).chat.completions.create(
        model=MODEL_ID,
        messages=MESSAGES,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema, "strict": True},
        },
    )
    sent = core.requests[0].response_format
    assert sent.type == core_pb2.ResponseFormat.JSON_SCHEMA
    assert (json.loads(sent.schema_json), sent.name, sent.strict) == (schema, "answer", True)


def test_response_format_json_object_and_parse_helper(gateway_url: str, core: CoreDouble) -> None:
    core.script.words = ['{"capital":', ' "Paris"}']
    client = sync_client(gateway_url)
    client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, response_format={"type": "json_object"})
    assert core.requests[0].response_format.type == core_pb2.ResponseFormat.JSON_OBJECT

    class Answer(BaseModel):
        capital: str

    parsed = client.chat.completions.parse(model=MODEL_ID, messages=MESSAGES, response_format=Answer)
    assert parsed.choices[0].message.parsed == Answer(capital="Paris")
    sent = core.requests[1].response_format
    assert sent.type == core_pb2.ResponseFormat.JSON_SCHEMA and sent.name == "Answer"
    assert json.loads(sent.schema_json)["required"] == ["capital"]


def test_text_response_format_is_unconstrained(gateway_url: str, core: CoreDouble) -> None:
    sync_client(gateway_url).chat.completions.create(
        model=MODEL_ID, messages=MESSAGES, response_format={"type": "text"}
    )
    assert not core.requests[0].HasField("response_format")


def test_logit_bias_reaches_core(gateway_url: str, core: CoreDouble) -> None:
    sync_client(gateway_url).chat.completions.create(
        model=MODEL_ID, messages=MESSAGES, logit_bias={"9707": -100, "42": 2.5}
    )
    assert dict(core.requests[0].sampling.logit_bias) == {9707: -100.0, 42: 2.5}


@pytest.mark.parametrize("bias", [{"x": 1}, {"5": 101}, {"-3": 1}])
def test_bad_logit_bias_is_400(gateway_url: str, core: CoreDouble, bias) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        sync_client(gateway_url).chat.completions.create(model=MODEL_ID, messages=MESSAGES, logit_bias=bias)
    assert raised.value.body["param"] == "logit_bias"


def test_cached_tokens_in_usage(gateway_url: str, core: CoreDouble) -> None:
    core.script.cached_prompt_tokens = 8
    completion = sync_client(gateway_url).chat.completions.create(model=MODEL_ID, messages=MESSAGES)
    assert completion.usage.prompt_tokens_details.cached_tokens == 8


def test_context_length_exceeded_code(gateway_url: str, core: CoreDouble) -> None:
    core.script.abort_code = grpc.StatusCode.INVALID_ARGUMENT
    core.script.abort_message = (
        "context_length_exceeded: 30 prompt tokens + max_tokens 5000 exceed the model's context of 2048"
    )
    with pytest.raises(openai.BadRequestError) as raised:
        sync_client(gateway_url).chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=5000)
    assert raised.value.code == "context_length_exceeded"
    assert "2048" in raised.value.body["message"]


def test_unknown_model_is_404(gateway_url: str, core: CoreDouble) -> None:
    with pytest.raises(openai.NotFoundError):
        sync_client(gateway_url).chat.completions.create(model="gpt-17", messages=MESSAGES)


def test_developer_role_is_system(gateway_url: str, core: CoreDouble) -> None:
    sync_client(gateway_url).chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    )
    assert [m.role for m in core.requests[0].chat.messages] == ["system", "user"]


def test_continue_final_message_reaches_core(gateway_url: str, core: CoreDouble) -> None:
    """vLLM's extension for a prefill: the last (assistant) message is continued."""
    prefill = [*MESSAGES, {"role": "assistant", "content": "The capital of France is"}]
    sync_client(gateway_url).chat.completions.create(
        model=MODEL_ID,
        messages=prefill,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert core.requests[-1].chat.continue_final_message


@pytest.mark.parametrize(
    "extra, last_role",
    [
        ({"continue_final_message": True, "add_generation_prompt": False}, "user"),
        ({"continue_final_message": True}, "assistant"),  # add_generation_prompt defaults to true
        ({"add_generation_prompt": False}, "assistant"),  # only served with a continuation
    ],
)
def test_inconsistent_continuation_flags_are_400(
    gateway_url: str, core: CoreDouble, extra, last_role
) -> None:
    messages = MESSAGES if last_role == "user" else [*MESSAGES, {"role": "assistant", "content": "It is"}]
    with pytest.raises(openai.BadRequestError):
        sync_client(gateway_url).chat.completions.create(model=MODEL_ID, messages=messages, extra_body=extra)
    assert core.requests == []


def test_logprob_bytes_are_the_tokens_own_and_join_into_the_content(
    gateway_url: str, core: CoreDouble
) -> None:
    """A token holding part of a character shows as U+FFFD alone; its bytes are its own, so that
    clients joining them get the content back (OpenAI's reason for `bytes`)."""
    from .test_gateway_completions import SPLIT_CHARACTERS

    core.script.token_bytes = SPLIT_CHARACTERS
    completion = sync_client(gateway_url).chat.completions.create(
        model=MODEL_ID, messages=MESSAGES, logprobs=True, top_logprobs=1
    )
    choice = completion.choices[0]
    items = choice.logprobs.content
    assert bytes(b for item in items for b in item.bytes).decode() == choice.message.content == "日本🚀 ok"
    assert items[1].token == "\ufffd" and items[1].bytes == [0xE6, 0x9C]
