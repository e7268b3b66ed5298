"""The gateway in front of a real core and a real expert worker (processes, Unix sockets), as users run it.

Two models: a tiny random `qwen3_moe` with the real Qwen3 tokenizer and chat template, checked against
mlx-lm's own greedy generation (the oracle), and the MoEfied SmolLM2 demo model, which must answer
"Paris" through every API. Clients are the official `openai` and `anthropic` packages.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Literal

import anthropic
import grpc
import httpx
import openai
import pytest

from services.common.manifest import Manifest
from services.proto.moemesh.v1 import core_pb2, core_pb2_grpc
from tests.helpers import Workers, core_args, short_dir, spawn, stop, wait_serving

from .conftest import GatewayThread

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
pytestmark = pytest.mark.slow


class LiveStack:
    """One expert worker holding every expert, a core over it, and the gateway in front."""

    def __init__(self, split: Path) -> None:
        self.split = split
        self.workdir = short_dir("mm-gw-")
        experts = Manifest.load(split).num_experts
        self.workers = Workers(split, self.workdir, [f"0-{experts - 1}"]).start()
        self.core_address = f"unix:{self.workdir / 'core.sock'}"
        self.core_log = self.workdir / "core.log"
        self.core = spawn(core_args(split, self.core_address, self.workers.addresses), self.core_log)
        wait_serving(self.core_address, self.core, log_path=self.core_log)
        self.gateway = GatewayThread(self.core_address).start()
        self.url = self.gateway.url
        self.model = httpx.get(self.url + "/v1/models").json()["data"][0]["id"]

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key="unused", max_retries=0, timeout=120)

    def running_requests(self) -> int:
        with grpc.insecure_channel(self.core_address) as channel:
            return (
                core_pb2_grpc.CoreStub(channel)
                .GetStats(core_pb2.GetStatsRequest(), timeout=5)
                .running_requests
            )

    def close(self) -> None:
        self.gateway.stop()
        stop([self.core])
        self.workers.stop()


@pytest.fixture(scope="module")
def qwen3(tiny_models):
    stack = LiveStack(tiny_models.split("qwen3_moe", None))
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def demo():
    from services.ops.up import resolve_split

    stack = LiveStack(resolve_split(None))
    yield stack
    stack.close()


def mlx_lm_greedy(checkpoint: Path, messages: list[dict], max_tokens: int) -> str:
    """The oracle: mlx-lm's own chat template and greedy decode on the unsplit checkpoint, as the
    tokenizer decodes those tokens (mlx_lm.generate's streaming detokenizer drops a leading space
    that `tokenizer.decode` and OpenAI-style servers keep)."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = mlx_lm.load(str(checkpoint))
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    steps = generate_step(mx.array(prompt), model, sampler=make_sampler(temp=0.0), max_tokens=max_tokens)
    return tokenizer.decode([int(token) for token, _ in steps])


def test_qwen3_chat_equals_mlx_lm(qwen3: LiveStack, tiny_models) -> None:
    reply = qwen3.openai().chat.completions.create(
        model=qwen3.model, messages=QUESTION, temperature=0, max_tokens=12, extra_body={"ignore_eos": True}
    )
    expected = mlx_lm_greedy(tiny_models.checkpoint("qwen3_moe", None), QUESTION, 12)
    choice = reply.choices[0]
    assert (choice.message.content or "") + (getattr(choice.message, "reasoning_content", None) or "") != ""
    assert choice.message.content == expected
    assert choice.finish_reason == "length" and reply.usage.completion_tokens == 12
    assert reply.usage.prompt_tokens == 15  # Qwen3's template around the question


def test_qwen3_stream_equals_whole(qwen3: LiveStack) -> None:
    client = qwen3.openai()
    kwargs = {
        "model": qwen3.model,
        "messages": QUESTION,
        "temperature": 0,
        "max_tokens": 10,
        "logprobs": True,
        "top_logprobs": 2,
    }
    whole = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    tokens = [
        item.token
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for item in c.choices[0].logprobs.content
    ]
    assert tokens == [item.token for item in whole.choices[0].logprobs.content]
    assert all(
        len(item.top_logprobs) == 2 and item.logprob <= 0 for item in whole.choices[0].logprobs.content
    )


async def test_qwen3_async_client(qwen3: LiveStack) -> None:
    client = openai.AsyncOpenAI(base_url=f"{qwen3.url}/v1", api_key="unused", max_retries=0, timeout=120)
    reply = await client.chat.completions.create(
        model=qwen3.model, messages=QUESTION, temperature=0, max_tokens=6
    )
    await client.close()
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens <= 6


def test_qwen3_completions_prompt_and_token_ids(qwen3: LiveStack) -> None:
    client = qwen3.openai()
    text = client.completions.create(
        model=qwen3.model, prompt="The capital of France is", max_tokens=6, temperature=0
    )
    ids = client.completions.create(
        model=qwen3.model, prompt=[785, 6722, 315, 9625, 374], max_tokens=6, temperature=0
    )
    assert text.choices[0].text == ids.choices[0].text  # the same five Qwen3 tokens
    assert text.usage.prompt_tokens == ids.usage.prompt_tokens == 5


def test_qwen3_completions_batch_answers_each_prompt_as_alone(qwen3: LiveStack) -> None:
    client = qwen3.openai()
    prompts = ["The capital of France is", "One, two, three,", "Water boils at"]
    alone = [
        client.completions.create(model=qwen3.model, prompt=p, max_tokens=6, temperature=0) for p in prompts
    ]
    batch = client.completions.create(model=qwen3.model, prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)


def test_qwen3_n_choices_are_the_seeded_answers_sent_alone(qwen3: LiveStack) -> None:
    client = qwen3.openai()
    kwargs = {"model": qwen3.model, "messages": QUESTION, "max_tokens": 8, "temperature": 1.0}
    alone = [client.chat.completions.create(**kwargs, seed=s).choices[0].message.content for s in (11, 12)]
    both = client.chat.completions.create(**kwargs, seed=11, n=2)
    assert [c.message.content for c in both.choices] == alone
    streamed = ["", ""]
    for chunk in client.chat.completions.create(**kwargs, seed=11, n=2, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == alone


def test_qwen3_anthropic_client(qwen3: LiveStack) -> None:
    client = qwen3.anthropic()
    whole = client.messages.create(
        model=qwen3.model, max_tokens=8, messages=QUESTION, extra_body={"temperature": 0}
    )
    with client.messages.stream(
        model=qwen3.model, max_tokens=8, messages=QUESTION, extra_body={"temperature": 0}
    ) as stream:
        events = list(stream)
        streamed = "".join(
            e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta"
        )
        final = stream.get_final_message()
    start = events[0].message.usage  # Anthropic's input counters are disjoint: their sum is the prompt
    assert events[0].type == "message_start" and start.input_tokens + start.cache_read_input_tokens == 15
    text = "".join(block.text for block in whole.content if block.type == "text")
    assert streamed == text and final.usage.output_tokens == whole.usage.output_tokens
    assert whole.stop_reason in ("end_turn", "max_tokens")
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == 15


def test_qwen3_errors(qwen3: LiveStack) -> None:
    client = qwen3.openai()
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=qwen3.model, messages=QUESTION, max_tokens=10**7)
    assert raised.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="not-this-one", messages=QUESTION, max_tokens=2)
    assert (not_found.value.code, not_found.value.param) == ("model_not_found", "model")  # OpenAI's names
    with pytest.raises(anthropic.NotFoundError):  # counting names the model as generating does
        qwen3.anthropic().messages.count_tokens(model="not-this-one", messages=QUESTION)
    with pytest.raises(anthropic.BadRequestError) as anthropic_error:
        qwen3.anthropic().messages.create(model=qwen3.model, max_tokens=10**7, messages=QUESTION)
    assert anthropic_error.value.body["error"]["type"] == "invalid_request_error"


def test_qwen3_kv_cache_per_request(qwen3: LiveStack) -> None:
    """`kv_cache` (a moe-mesh extension) picks the request's KV cache; an unknown kind is a 400."""
    client = qwen3.openai()
    kwargs = {"model": qwen3.model, "messages": QUESTION, "temperature": 0, "max_tokens": 6}
    compressed = client.chat.completions.create(**kwargs, extra_body={"kv_cache": "turboquant"})
    assert compressed.usage.completion_tokens == 6 or compressed.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(**kwargs, extra_body={"kv_cache": "int3-magic"})
    assert "kv_cache" in raised.value.message


def test_qwen3_disconnect_frees_the_sequence(qwen3: LiveStack) -> None:
    body = {
        "model": qwen3.model,
        "messages": QUESTION,
        "stream": True,
        "max_tokens": 2000,
        "ignore_eos": True,
    }
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", qwen3.url + "/v1/chat/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        contents = 0
        for line in lines:
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                contents += 1
            if contents == 3:
                break
        assert qwen3.running_requests() == 1
    deadline = time.monotonic() + 10
    while qwen3.running_requests() != 0:
        assert time.monotonic() < deadline, "core still generates for a client that left"
        time.sleep(0.05)


def test_qwen3_request_id_reaches_core_logs(qwen3: LiveStack) -> None:
    response = httpx.post(
        qwen3.url + "/v1/chat/completions",
        json={"model": qwen3.model, "messages": QUESTION, "max_tokens": 2},
        headers={"X-Request-Id": "live-rid-42"},
        timeout=60,
    )
    assert (
        response.headers["x-request-id"] == "live-rid-42" and response.json()["id"] == "chatcmpl-live-rid-42"
    )
    time.sleep(0.2)
    records = [json.loads(line) for line in qwen3.core_log.read_text().splitlines() if line.startswith("{")]
    mine = [record for record in records if record.get("request_id") == "live-rid-42"]
    assert {"generate_start", "generate_done"} <= {record["event"] for record in mine}


def test_demo_answers_paris_through_every_api(demo: LiveStack) -> None:
    # 7 tokens hold "The capital of France is Paris" (the demo decodes ~4 tokens/s on 2 CPU cores).
    stream = demo.openai().chat.completions.create(
        model=demo.model, messages=QUESTION, temperature=0, max_tokens=7, stream=True
    )
    openai_text = "".join(chunk.choices[0].delta.content or "" for chunk in stream)
    assert "Paris" in openai_text
    message = demo.anthropic().messages.create(
        model=demo.model, max_tokens=7, messages=QUESTION, extra_body={"temperature": 0}
    )
    assert message.content[0].text == openai_text


def test_qwen3_stop_sequences_cut_where_the_greedy_text_has_them(qwen3: LiveStack) -> None:
    client = qwen3.openai()
    full = (
        client.chat.completions.create(
            model=qwen3.model,
            messages=QUESTION,
            temperature=0,
            max_tokens=12,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .message.content
    )
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    cut = client.chat.completions.create(
        model=qwen3.model, messages=QUESTION, temperature=0, max_tokens=12, stop=[stop]
    ).choices[0]
    assert cut.message.content == full[: full.index(stop)] and cut.finish_reason == "stop"
    message = qwen3.anthropic().messages.create(
        model=qwen3.model,
        max_tokens=12,
        messages=QUESTION,
        stop_sequences=[stop],
        extra_body={"temperature": 0},
    )
    assert message.content[0].text == cut.message.content
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)


def test_qwen3_completions_echo(qwen3: LiveStack) -> None:
    prompt = "The capital of France is"
    client = qwen3.openai()
    plain = client.completions.create(model=qwen3.model, prompt=prompt, max_tokens=4, temperature=0)
    echoed = client.completions.create(
        model=qwen3.model, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=1
    )
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    logprobs = echoed.choices[0].logprobs
    # the prompt's tokens, scored (the first has no context), then the answer's
    assert "".join(logprobs.tokens) == prompt + plain.choices[0].text
    assert logprobs.token_logprobs[0] is None and all(v is not None for v in logprobs.token_logprobs[1:])
    text = echoed.choices[0].text
    assert [
        text[o : o + len(t)] for o, t in zip(logprobs.text_offset, logprobs.tokens, strict=True)
    ] == logprobs.tokens


def test_qwen3_count_tokens_and_model(qwen3: LiveStack) -> None:
    counted = qwen3.anthropic().messages.count_tokens(model=qwen3.model, messages=QUESTION)
    assert counted.input_tokens == 15  # what generation reports as the prompt (see above)
    assert qwen3.openai().models.retrieve(qwen3.model).id == qwen3.model


UNIT_TOOL = {
    "type": "function",
    "function": {
        "name": "set_unit",
        "description": "Choose the temperature unit",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["unit"],
            "additionalProperties": False,
        },
    },
}


def test_qwen3_forced_tool_call_streams_to_the_openai_helper(qwen3: LiveStack) -> None:
    """tool_choice names a function: core's grammar makes even random weights write a Qwen3
    `<tool_call>`, core's parser turns it into a ToolCall, the gateway streams it as OpenAI does."""
    with qwen3.openai().chat.completions.stream(
        model=qwen3.model,
        messages=[{"role": "user", "content": "Use celsius."}],
        tools=[UNIT_TOOL],
        tool_choice={"type": "function", "function": {"name": "set_unit"}},
        max_tokens=64,
    ) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [call.function.name for call in choice.message.tool_calls] == ["set_unit"]
    assert json.loads(choice.message.tool_calls[0].function.arguments)["unit"] in ("celsius", "fahrenheit")
    assert choice.message.tool_calls[0].id


def test_qwen3_forced_tool_use_in_anthropic_shape(qwen3: LiveStack) -> None:
    tool = {"name": "set_unit", "input_schema": UNIT_TOOL["function"]["parameters"]}
    message = qwen3.anthropic().messages.create(
        model=qwen3.model,
        max_tokens=64,
        messages=[{"role": "user", "content": "Use celsius."}],
        tools=[tool],
        tool_choice={"type": "tool", "name": "set_unit"},
    )
    uses = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and [use.name for use in uses] == ["set_unit"]
    assert uses[0].input["unit"] in ("celsius", "fahrenheit")


def test_qwen3_json_schema_output_parses(qwen3: LiveStack) -> None:
    from pydantic import BaseModel

    class Unit(BaseModel):
        unit: Literal["celsius", "fahrenheit"]

    parsed = qwen3.openai().chat.completions.parse(
        model=qwen3.model,
        messages=[{"role": "user", "content": "Pick a unit."}],
        response_format=Unit,
        max_tokens=64,
    )
    assert isinstance(parsed.choices[0].message.parsed, Unit)


QWEN3_THINK_START = 151667  # "<think>" in the Qwen3 vocabulary


def test_qwen3_logit_bias_and_reasoning_separation(qwen3: LiveStack) -> None:
    """A +100 bias on `<think>` makes random weights open a thinking block and repeat the marker:
    logit_bias reached the sampler, and what follows the first marker is reasoning_content, never
    content, whole or streamed."""
    client = qwen3.openai()
    kwargs = {"model": qwen3.model, "messages": QUESTION, "max_tokens": 4, "temperature": 0}
    unbiased = client.chat.completions.create(**kwargs).choices[0].message
    assert unbiased.content and not getattr(unbiased, "reasoning_content", None)
    biased = {**kwargs, "logit_bias": {str(QWEN3_THINK_START): 100}}
    message = client.chat.completions.create(**biased).choices[0].message
    assert not message.content
    assert message.reasoning_content == "<think>" * 3  # type: ignore[attr-defined]
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**biased, stream=True):
        if chunk.choices:
            reasoning += getattr(chunk.choices[0].delta, "reasoning_content", None) or ""
            content += chunk.choices[0].delta.content or ""
    assert (reasoning, content) == ("<think>" * 3, "")


def test_qwen3_tokenize_and_detokenize_as_vllm(qwen3: LiveStack) -> None:
    """vLLM's /tokenize and /detokenize: the ids core generates from, a chat through its template
    (as many as the chat's usage.prompt_tokens), and ids back to the same text."""
    text = "The capital of France is Paris."
    tokenized = httpx.post(qwen3.url + "/tokenize", json={"model": qwen3.model, "prompt": text}).json()
    assert tokenized["count"] == len(tokenized["tokens"]) > 0 and tokenized["max_model_len"] > 0
    back = httpx.post(qwen3.url + "/detokenize", json={"model": qwen3.model, "tokens": tokenized["tokens"]})
    assert back.json() == {"prompt": text}
    chat = httpx.post(qwen3.url + "/tokenize", json={"model": qwen3.model, "messages": QUESTION}).json()
    reply = qwen3.openai().chat.completions.create(model=qwen3.model, messages=QUESTION, max_tokens=1)
    assert chat["count"] == reply.usage.prompt_tokens
    missing = httpx.post(qwen3.url + "/tokenize", json={"model": "not-this-one", "prompt": text})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    outside = httpx.post(qwen3.url + "/detokenize", json={"tokens": [10**9]})
    assert outside.status_code == 400 and "vocabulary" in outside.json()["error"]["message"]
