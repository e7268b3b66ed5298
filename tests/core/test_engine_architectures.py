"""The served engine (continuous batching, chunked prefill, prefix cache, step-merged expert
calls) on architectures whose caches are not plain KV: qwen3_5_moe (Gated DeltaNet recurrent
state beside attention), gpt_oss (sliding-window layers), deepseek_v3 (MLA), llama4 (chunked
attention, whose prompts here cross chunks and prefill chunks alike). Every request,
batched with others and reusing a cached prefix, gives mlx-lm's own greedy tokens on the
original checkpoint, and requests that share a system prompt start from its cached state."""

from __future__ import annotations

import asyncio

import grpc
import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

from services.proto.moemesh.v1 import core_pb2, core_pb2_grpc
from tests.helpers import Workers, core_args, short_dir, spawn, stop, wait_serving

pytestmark = pytest.mark.slow  # starts processes or computes for seconds

SYSTEM = "You are a terse assistant. " + " ".join(f"Rule {i}: be brief and exact." for i in range(20))
QUESTIONS = ["What is the capital of France?", "Name a prime number.", "Which ocean is largest?"]
TOKENS = 8


def request(question: str) -> core_pb2.GenerateRequest:
    messages = [
        core_pb2.ChatMessage(role="system", content=SYSTEM),
        core_pb2.ChatMessage(role="user", content=question),
    ]
    return core_pb2.GenerateRequest(
        chat=core_pb2.ChatInput(messages=messages, add_generation_prompt=True),
        sampling=core_pb2.SamplingParams(temperature=0),
        stopping=core_pb2.StoppingCriteria(max_tokens=TOKENS, ignore_eos=True),
    )


def prompt_tokens(tokenizer, question: str) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


async def generate(stub, req) -> tuple[list[int], core_pb2.Usage]:
    tokens, usage = [], None
    async for chunk in stub.Generate(req, timeout=300):
        tokens.extend(chunk.token_ids)
        usage = chunk.usage
    return tokens, usage


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "gpt_oss", "deepseek_v3", "llama4"])
def test_batched_and_prefix_cached_requests_match_mlx_lm(tiny_models, arch):
    checkpoint, split = tiny_models.checkpoint(arch, 4), tiny_models.split(arch, 4)
    model, tokenizer = mlx_lm.load(str(checkpoint))
    oracle = [
        [int(t) for t, _ in generate_step(mx.array(prompt_tokens(tokenizer, q)), model, max_tokens=TOKENS)]
        for q in QUESTIONS
    ]

    workdir = short_dir()
    workers = Workers(split, workdir, ["0-7"]).start()
    address, log = f"unix:{workdir / 'core.sock'}", workdir / "core.log"
    # A small token budget: prompts prefill in chunks, interleaved with the others' decode.
    core = spawn(core_args(split, address, workers.addresses, "--max-num-batched-tokens", "48"), log)
    try:
        wait_serving(address, core, timeout_s=120, log_path=log)

        async def scenario():
            async with grpc.aio.insecure_channel(address) as channel:
                stub = core_pb2_grpc.CoreStub(channel)
                first = await generate(stub, request(QUESTIONS[0]))  # alone; fills the prefix cache
                together = await asyncio.gather(*(generate(stub, request(q)) for q in QUESTIONS))
                return first, together

        first, together = asyncio.run(scenario())
    finally:
        stop([core])
        workers.stop()
    assert first[0] == oracle[0]
    for i, (tokens, _) in enumerate(together):
        assert tokens == oracle[i], f"{arch}: request {i} differs from mlx-lm when batched"
    # Every later request starts from the cached system prompt (a snapshot kept where it ends:
    # the only reusable point for caches that cannot be trimmed back), the repeat from more.
    system_tokens = len(tokenizer.encode(SYSTEM))
    assert together[0][1].cached_prompt_tokens > system_tokens, together[0][1]
    for i, (_, usage) in enumerate(together[1:], 1):
        assert system_tokens < usage.cached_prompt_tokens < usage.prompt_tokens, (i, usage)
