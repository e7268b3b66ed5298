"""Constrained decoding, logit_bias and echo through a real core process over real expert workers.

The tiny qwen3_moe has random weights and the real Qwen3 tokenizer (151k tokens), so
whatever it would write on its own is noise: output that parses and validates is the
grammar's doing, not the model's.
"""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest

from services.proto.moemesh.v1 import core_pb2, core_pb2_grpc
from tests.core.test_core_service import Stack, generate, tokens_of
from tests.helpers import short_dir, stop, wait_serving

pytestmark = pytest.mark.slow  # starts processes or computes for seconds

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "mood": {"enum": ["happy", "sad"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "age", "mood", "tags"],
    "additionalProperties": False,
}
WEATHER = core_pb2.Tool(
    name="get_weather",
    parameters_json=json.dumps(
        {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer"}},
            "required": ["city", "days"],
            "additionalProperties": False,
        }
    ),
)
TIME = core_pb2.Tool(name="get_time", parameters_json='{"type": "object", "properties": {}}')


@pytest.fixture(scope="module")
def stack(tiny_models):
    workdir = short_dir()
    stack = Stack(tiny_models.split("qwen3_moe", None), workdir)
    stack.workers.start()
    wait_serving(stack.core_address, stack.core, log_path=stack.core_log)
    yield stack
    stop([stack.core])
    stack.workers.stop()


def text_of(chunks) -> str:
    return "".join(c.text for c in chunks)


def schema_request(schema: dict, **sampling) -> core_pb2.GenerateRequest:
    return core_pb2.GenerateRequest(
        chat=core_pb2.ChatInput(
            messages=[core_pb2.ChatMessage(role="user", content="Describe a person as JSON.")]
        ),
        response_format=core_pb2.ResponseFormat(
            type=core_pb2.ResponseFormat.JSON_SCHEMA, schema_json=json.dumps(schema), name="person"
        ),
        sampling=core_pb2.SamplingParams(**sampling),
        stopping=core_pb2.StoppingCriteria(max_tokens=120),
    )


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7}])
async def test_json_schema_output_parses_and_validates(stack, sampling):
    chunks = await generate(stack, schema_request(PERSON, **sampling))
    assert chunks[-1].finish_reason == core_pb2.FinishReason.STOP
    value = json.loads(text_of(chunks))
    jsonschema.validate(value, PERSON)


async def test_json_object_output_is_an_object(stack):
    request = core_pb2.GenerateRequest(
        prompt="Some JSON:",
        response_format=core_pb2.ResponseFormat(type=core_pb2.ResponseFormat.JSON_OBJECT),
        sampling=core_pb2.SamplingParams(temperature=0),
        stopping=core_pb2.StoppingCriteria(max_tokens=6),
    )
    chunks = await generate(stack, request)
    text = text_of(chunks)
    assert text.startswith("{")
    if chunks[-1].finish_reason == core_pb2.FinishReason.STOP:
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens, reported as OpenAI does
        assert chunks[-1].finish_reason == core_pb2.FinishReason.LENGTH


async def test_without_a_grammar_the_same_model_does_not_write_json(stack):
    """The control: the constraint, not luck, makes the output above parse."""
    request = schema_request(PERSON, temperature=0)
    request.ClearField("response_format")
    request.stopping.max_tokens = 30
    chunks = await generate(stack, request)
    with pytest.raises(json.JSONDecodeError):
        json.loads(text_of(chunks))


async def test_named_tool_choice_forces_a_valid_call_of_that_tool(stack):
    request = core_pb2.GenerateRequest(
        chat=core_pb2.ChatInput(
            messages=[core_pb2.ChatMessage(role="user", content="Weather?")],
            tools=[TIME, WEATHER],
            tool_choice=core_pb2.ToolChoice(mode=core_pb2.ToolChoice.NAMED, function_name="get_weather"),
        ),
        sampling=core_pb2.SamplingParams(temperature=0),
        stopping=core_pb2.StoppingCriteria(max_tokens=80),
    )
    chunks = await generate(stack, request)
    calls = [call for c in chunks for call in c.tool_calls]
    assert [c.name for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0].arguments), json.loads(WEATHER.parameters_json))
    assert text_of(chunks) == ""
    assert chunks[-1].finish_reason == core_pb2.FinishReason.TOOL_CALLS


async def test_required_tool_choice_calls_one_of_the_tools(stack):
    request = core_pb2.GenerateRequest(
        chat=core_pb2.ChatInput(
            messages=[core_pb2.ChatMessage(role="user", content="Weather?")],
            tools=[TIME, WEATHER],
            tool_choice=core_pb2.ToolChoice(mode=core_pb2.ToolChoice.REQUIRED),
        ),
        sampling=core_pb2.SamplingParams(temperature=1.0, seed=3),
        stopping=core_pb2.StoppingCriteria(max_tokens=120),
    )
    chunks = await generate(stack, request)
    calls = [call for c in chunks for call in c.tool_calls]
    assert calls and {c.name for c in calls} <= {"get_time", "get_weather"}
    assert [c.index for c in calls] == list(range(len(calls)))
    for call in calls:
        assert isinstance(json.loads(call.arguments), dict)
    assert chunks[-1].finish_reason == core_pb2.FinishReason.TOOL_CALLS


async def test_logit_bias_forces_and_bans_tokens(stack):
    base = core_pb2.GenerateRequest(
        prompt="Hello",
        sampling=core_pb2.SamplingParams(temperature=0),
        stopping=core_pb2.StoppingCriteria(max_tokens=4),
    )
    free = tokens_of(await generate(stack, base))
    forced = core_pb2.GenerateRequest()
    forced.CopyFrom(base)
    forced.sampling.logit_bias[9707] = 100  # "Hello"
    assert tokens_of(await generate(stack, forced)) == [9707] * 4
    banned = core_pb2.GenerateRequest()
    banned.CopyFrom(base)
    banned.sampling.logit_bias[free[0]] = -100
    assert free[0] not in tokens_of(await generate(stack, banned))


async def test_echo_puts_the_prompt_in_the_first_chunk(stack):
    request = core_pb2.GenerateRequest(
        prompt="Echo this prompt",
        echo=True,
        sampling=core_pb2.SamplingParams(temperature=0),
        stopping=core_pb2.StoppingCriteria(max_tokens=3),
    )
    chunks = await generate(stack, request)
    assert chunks[0].text.startswith("Echo this prompt")
    assert sum(len(c.token_ids) for c in chunks) == 3


async def test_an_invalid_schema_is_invalid_argument_and_the_core_keeps_serving(stack):
    request = schema_request({"type": "object", "properties": {"a": {"type": "bogus"}}})
    async with stack.channel() as channel:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await core_pb2_grpc.CoreStub(channel).Generate(request, timeout=30).read()
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "response_format" in error.value.details()
    chunks = await generate(stack, schema_request(PERSON, temperature=0))
    jsonschema.validate(json.loads(text_of(chunks)), PERSON)


async def test_thinking_text_arrives_as_reasoning_not_text(stack):
    """logit_bias forces Qwen3's `<think>` token: everything after it is reasoning."""
    think = 151667
    request = core_pb2.GenerateRequest(
        chat=core_pb2.ChatInput(messages=[core_pb2.ChatMessage(role="user", content="Think.")]),
        sampling=core_pb2.SamplingParams(temperature=0, logit_bias={think: 100}),
        stopping=core_pb2.StoppingCriteria(max_tokens=4),
    )
    chunks = await generate(stack, request)
    assert tokens_of(chunks) == [think] * 4
    assert text_of(chunks) == ""
    assert "".join(c.reasoning for c in chunks) == "<think>" * 3


async def test_a_stop_string_is_named_in_the_last_chunk(stack):
    request = core_pb2.GenerateRequest(
        prompt="Count with me:",
        sampling=core_pb2.SamplingParams(temperature=0),
        stopping=core_pb2.StoppingCriteria(max_tokens=8),
    )
    free = await generate(stack, request)
    stop_at = next(c.text for c in free[2:] if c.text.strip())
    request.stopping.stop.append(stop_at)
    chunks = await generate(stack, request)
    assert chunks[-1].finish_reason == core_pb2.FinishReason.STOP
    assert chunks[-1].matched_stop == stop_at
    assert stop_at not in text_of(chunks)
