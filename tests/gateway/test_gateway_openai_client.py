"""The gateway as the official `openai` client sees it (sync and async, streaming and not)."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import openai
import pytest

from services.proto.moemesh.v1 import core_pb2

from .core_double import ANSWER, ANSWER_WORDS, MODEL_ID, CoreDouble

MESSAGES = [
    {"role": "system", "content": "You answer in one sentence."},
    {"role": "user", "content": "What is the capital of France?"},
]
PROMPT_TOKENS = 5 + 6  # the double counts whitespace-separated words


def sync_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)


def async_client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)


def test_sync_completion(gateway_url: str, core: CoreDouble) -> None:
    completion = sync_client(gateway_url).chat.completions.create(model=MODEL_ID, messages=MESSAGES)
    assert completion.object == "chat.completion"
    assert completion.id.startswith("chatcmpl-")
    assert completion.model == MODEL_ID
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == ANSWER
    assert choice.finish_reason == "stop"
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (PROMPT_TOKENS, 7)
    assert completion.usage.total_tokens == PROMPT_TOKENS + 7
    sent = core.requests[0]
    assert sent.model == MODEL_ID
    assert [(m.role, m.content) for m in sent.chat.messages] == [(m["role"], m["content"]) for m in MESSAGES]
    assert sent.chat.add_generation_prompt


def test_sync_stream_with_usage(gateway_url: str, core: CoreDouble) -> None:
    stream = sync_client(gateway_url).chat.completions.create(
        model=MODEL_ID, messages=MESSAGES, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert len({chunk.id for chunk in chunks}) == 1
    deltas = [c.choices[0].delta.content for c in chunks[1:] if c.choices and c.choices[0].delta.content]
    assert deltas == ANSWER_WORDS
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["stop"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 7
    assert chunks[-1].usage.prompt_tokens == PROMPT_TOKENS
    assert all(chunk.usage is None for chunk in chunks[:-1])


def test_stream_without_usage_has_no_usage_chunk(gateway_url: str, core: CoreDouble) -> None:
    chunks = list(
        sync_client(gateway_url).chat.completions.create(model=MODEL_ID, messages=MESSAGES, stream=True)
    )
    assert all(chunk.choices for chunk in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_async_completion_and_stream(gateway_url: str, core: CoreDouble) -> None:
    client = async_client(gateway_url)
    completion = await client.chat.completions.create(model=MODEL_ID, messages=MESSAGES)
    assert completion.choices[0].message.content == ANSWER
    stream = await client.chat.completions.create(
        model=MODEL_ID, messages=MESSAGES, stream=True, stream_options={"include_usage": True}
    )
    text, usage = "", None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        usage = chunk.usage or usage
    assert text == ANSWER
    assert usage is not None and usage.total_tokens == PROMPT_TOKENS + 7
    await client.close()


@pytest.mark.parametrize("seed", [7, None])
def test_n_choices_are_sampled_each_as_its_own_sequence(gateway_url: str, core: CoreDouble, seed) -> None:
    messages = [{"role": "user", "content": "Capital of France?"}]
    completion = sync_client(gateway_url).chat.completions.create(
        model=MODEL_ID, messages=messages, n=3, seed=seed, temperature=0.8
    )
    assert [choice.index for choice in completion.choices] == [0, 1, 2]
    assert all(choice.message.content == ANSWER for choice in completion.choices)
    assert len(core.requests) == 3 and len({r.request_id for r in core.requests}) == 3
    seeds = sorted(r.sampling.seed if r.sampling.HasField("seed") else -1 for r in core.requests)
    assert seeds == ([7, 8, 9] if seed is not None else [-1] * 3)  # seeded choices differ, reproducibly
    assert completion.usage.prompt_tokens == 3  # the prompt once, as OpenAI counts it
    assert completion.usage.completion_tokens == 3 * len(ANSWER_WORDS)


def test_n_streamed_choices_each_read_as_a_whole_answer(gateway_url: str, core: CoreDouble) -> None:
    messages = [{"role": "user", "content": "Capital of France?"}]
    stream = sync_client(gateway_url).chat.completions.create(
        model=MODEL_ID, messages=messages, n=3, stream=True, stream_options={"include_usage": True}
    )
    contents: dict[int, str] = {}
    roles, finishes, usages = set(), {}, []
    for chunk in stream:
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for choice in chunk.choices:
            contents[choice.index] = contents.get(choice.index, "") + (choice.delta.content or "")
            if choice.delta.role:
                roles.add(choice.index)
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert contents == {0: ANSWER, 1: ANSWER, 2: ANSWER} and roles == {0, 1, 2}
    assert finishes == {0: "stop", 1: "stop", 2: "stop"}
    assert len(usages) == 1 and usages[0].prompt_tokens == 3
    assert usages[0].completion_tokens == 3 * len(ANSWER_WORDS)


def test_an_error_in_one_streamed_choice_ends_the_stream_with_an_error_event(
    gateway_url: str, core: CoreDouble
) -> None:
    core.script.abort_code = grpc.StatusCode.UNAVAILABLE
    core.script.abort_after_chunks = 2  # after the stream began: only an error event can tell
    messages = [{"role": "user", "content": "Capital of France?"}]
    stream = sync_client(gateway_url).chat.completions.create(
        model=MODEL_ID, messages=messages, n=2, stream=True
    )
    with pytest.raises(openai.APIError):
        for _ in stream:
            pass
    deadline = time.monotonic() + 5
    while core.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert core.running == 0


def test_max_tokens_gives_length(gateway_url: str, core: CoreDouble) -> None:
    completion = sync_client(gateway_url).chat.completions.create(
        model=MODEL_ID, messages=MESSAGES, max_tokens=3
    )
    assert completion.choices[0].message.content == "The capital of"
    assert completion.choices[0].finish_reason == "length"
    assert core.requests[0].stopping.max_tokens == 3


def test_sampling_and_stopping_reach_core(gateway_url: str, core: CoreDouble) -> None:
    sync_client(gateway_url).chat.completions.create(
        model=MODEL_ID,
        messages=MESSAGES,
        temperature=0.5,
        top_p=0.9,
        seed=42,
        stop=["\n", "END"],
        presence_penalty=0.25,
        frequency_penalty=-0.5,
        max_completion_tokens=64,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "unknown_field": 1},
    )
    sent = core.requests[0]
    assert sent.sampling.temperature == pytest.approx(0.5)
    assert sent.sampling.top_p == pytest.approx(0.9)
    assert sent.sampling.top_k == 20
    assert sent.sampling.min_p == pytest.approx(0.05)
    assert sent.sampling.seed == 42
    assert sent.sampling.repetition_penalty == pytest.approx(1.1)
    assert sent.sampling.presence_penalty == pytest.approx(0.25)
    assert sent.sampling.frequency_penalty == pytest.approx(-0.5)
    assert list(sent.stopping.stop) == ["\n", "END"]
    assert sent.stopping.max_tokens == 64


def test_unset_sampling_stays_unset(gateway_url: str, core: CoreDouble) -> None:
    sync_client(gateway_url).chat.completions.create(model=MODEL_ID, messages=MESSAGES)
    sent = core.requests[0]
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty"):
        assert not sent.sampling.HasField(name), name
    assert not sent.stopping.HasField("max_tokens")


def test_explicit_nulls_mean_not_given(gateway_url: str, core: CoreDouble) -> None:
    """The SDK's types allow None for these (vLLM reads null as the default): no 400."""
    client = sync_client(gateway_url)
    completion = client.chat.completions.create(
        model=MODEL_ID, messages=MESSAGES, n=None, stream=None, logprobs=None, max_tokens=None
    )
    assert completion.choices[0].message.content == ANSWER
    text = client.completions.create(model=MODEL_ID, prompt="Hello", n=None, stream=None, echo=None)
    assert text.choices[0].text == ANSWER
    assert not any(request.echo for request in core.requests)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL_ID, messages=None)


def test_tool_calls_round_trip(gateway_url: str, core: CoreDouble) -> None:
    core.script.words = []
    core.script.finish_reason = core_pb2.TOOL_CALLS
    core.script.tool_calls = [
        core_pb2.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
    ]
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather now",
                "parameters": {"type": "object", "properties": {}},
            },
        }
    ]
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_0", "content": [{"type": "text", "text": "sunny"}]},
    ]
    completion = sync_client(gateway_url).chat.completions.create(
        model=MODEL_ID, messages=messages, tools=tools
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.tool_calls[0].id == "call_1"
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    sent = core.requests[0]
    assert sent.chat.tools[0].name == "get_weather"
    assert json.loads(sent.chat.tools[0].parameters_json) == {"type": "object", "properties": {}}
    assert sent.chat.messages[2].tool_calls[0].name == "get_weather"
    assert (sent.chat.messages[3].role, sent.chat.messages[3].tool_call_id) == ("tool", "call_0")
    assert sent.chat.messages[3].content == "sunny"

    stream = sync_client(gateway_url).chat.completions.create(
        model=MODEL_ID, messages=messages, tools=tools, stream=True
    )
    calls = [call for chunk in stream for call in (chunk.choices[0].delta.tool_calls or [])]
    # OpenAI's shape: a head delta (index, id, type, name, empty arguments), then argument deltas.
    assert [(call.index, call.id, call.function.name, call.function.arguments) for call in calls] == [
        (0, "call_1", "get_weather", ""),
        (0, None, None, '{"city": "Paris"}'),
    ]


def test_tool_choice_none_hides_tools(gateway_url: str, core: CoreDouble) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    sync_client(gateway_url).chat.completions.create(
        model=MODEL_ID, messages=MESSAGES, tools=tools, tool_choice="none"
    )
    assert len(core.requests[0].chat.tools) == 0


def test_logprobs(gateway_url: str, core: CoreDouble) -> None:
    completion = sync_client(gateway_url).chat.completions.create(
        model=MODEL_ID, messages=MESSAGES, logprobs=True, top_logprobs=1
    )
    content = completion.choices[0].logprobs.content
    assert [item.token for item in content] == ANSWER_WORDS
    assert content[0].logprob == pytest.approx(-0.5)
    assert content[0].top_logprobs[0].token == "The"
    assert core.requests[0].logprobs and core.requests[0].top_logprobs == 1


@pytest.mark.parametrize(
    ("code", "exception"),
    [
        (grpc.StatusCode.RESOURCE_EXHAUSTED, openai.RateLimitError),
        (grpc.StatusCode.NOT_FOUND, openai.NotFoundError),
        (grpc.StatusCode.INVALID_ARGUMENT, openai.BadRequestError),
        (grpc.StatusCode.UNAVAILABLE, openai.InternalServerError),
    ],
)
def test_core_errors_raise_typed_exceptions(gateway_url: str, core: CoreDouble, code, exception) -> None:
    core.script.abort_code = code
    with pytest.raises(exception):
        sync_client(gateway_url).chat.completions.create(model=MODEL_ID, messages=MESSAGES)
    with pytest.raises(exception):  # before the first token, a stream fails with the same status
        sync_client(gateway_url).chat.completions.create(model=MODEL_ID, messages=MESSAGES, stream=True)


def test_error_after_stream_started(gateway_url: str, core: CoreDouble) -> None:
    core.script.abort_code = grpc.StatusCode.INTERNAL
    core.script.abort_message = "secret /var/run/core.sock detail"
    core.script.abort_after_chunks = 2
    stream = sync_client(gateway_url).chat.completions.create(model=MODEL_ID, messages=MESSAGES, stream=True)
    received: list[str] = []
    with pytest.raises(openai.APIError) as raised:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                received.append(chunk.choices[0].delta.content)
    assert received == ANSWER_WORDS[:2]
    assert "secret" not in str(raised.value)


async def test_concurrent_streams_do_not_mix(gateway_url: str, core: CoreDouble) -> None:
    core.script.delay_per_chunk_s = 0.01  # interleave the streams
    client = async_client(gateway_url)

    async def one(index: int) -> tuple[str, str]:
        stream = await client.chat.completions.create(
            model=MODEL_ID, messages=MESSAGES, stream=True, extra_headers={"X-Request-Id": f"conc-{index}"}
        )
        text, completion_id = "", ""
        async for chunk in stream:
            completion_id = chunk.id
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
        return completion_id, text

    results = await asyncio.gather(*(one(index) for index in range(16)))
    await client.close()
    assert results == [(f"chatcmpl-conc-{index}", ANSWER) for index in range(16)]
    assert sorted(metadata["x-request-id"] for metadata in core.metadata) == sorted(
        f"conc-{index}" for index in range(16)
    )
