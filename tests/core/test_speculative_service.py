"""Speculative decoding through a real core process on the demo model: the same greedy tokens as a
core without it, fewer steps where the answer repeats the prompt, vLLM's counters on /metrics and in
GetStats, and `speculative: false` honoured per request."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from services.ops.up import resolve_split
from services.proto.moemesh.v1 import core_pb2, core_pb2_grpc
from services.tools.demo_model import ensure_demo_model
from tests.core.test_batching import GREEDY, run, running, wait_idle

CODE_EDIT = (
    "def area(width, height):\n    return width * height\n\n"
    "def perimeter(width, height):\n    return 2 * (width + height)\n\n"
    "# The same two functions, with type hints:\n"
)
QUESTION = "Q: Name three colours of the rainbow.\nA:"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cores():
    off = ["--prefix-cache-gb", "0"]
    draft = f"draft:{ensure_demo_model(dense=True, progress=False)}"  # the dense model it was made from
    configs = {
        "off": off,
        # with the prefix cache: caches whose slots speculation moved are reused from it; and two
        # micro-batches, so requests sent together draft and verify in lanes of their own
        "ngram": [
            *["--prefix-cache-gb", "1", "--speculative", "ngram", "--num-speculative-tokens", "4"],
            *["--speculative-config", json.dumps({"draft_cost": 0})],  # draft whatever a step costs here
            *["--micro-batches", "2"],
        ],
        "draft": [
            *off,
            "--speculative-config",
            json.dumps({"method": draft, "num_speculative_tokens": 3, "draft_cost": 0}),
        ],
    }
    with running(resolve_split(None), configs) as started:
        yield started["off"], started["ngram"], started["draft"]


def request(prompt: str, max_tokens: int, **kwargs) -> core_pb2.GenerateRequest:
    stopping = core_pb2.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True)
    return core_pb2.GenerateRequest(prompt=prompt, sampling=GREEDY, stopping=stopping, **kwargs)


async def generate(core, *requests):
    async with grpc.aio.insecure_channel(core.address) as channel:
        stub = core_pb2_grpc.CoreStub(channel)
        results = await asyncio.gather(*(run(stub, r) for r in requests))
        stats = await stub.GetStats(core_pb2.GetStatsRequest())
    return results, stats


async def test_greedy_tokens_match_a_core_without_speculation(cores):
    off, ngram, _ = cores
    requests = [request(CODE_EDIT, 40), request(QUESTION, 12, logprobs=True, top_logprobs=2)]
    plain, _ = await generate(off, *requests)
    drafted, stats = await generate(ngram, *requests)
    for (want, want_chunks), (got, got_chunks) in zip(plain, drafted, strict=True):
        assert got == want
        want_lp = [lp for c in want_chunks for lp in c.logprobs]
        got_lp = [lp for c in got_chunks for lp in c.logprobs]
        assert [lp.token_id for lp in got_lp] == [lp.token_id for lp in want_lp]
        for a, b in zip(got_lp, want_lp, strict=True):
            assert abs(a.logprob - b.logprob) < 1e-3
        assert got_chunks[-1].usage.completion_tokens == len(want)
    spec = stats.speculative
    assert spec.method == "ngram"
    assert spec.drafts > 0 and 0 < spec.accepted_tokens <= spec.draft_tokens
    assert (
        len(spec.accepted_per_position) == 4
        and spec.accepted_per_position[0] >= spec.accepted_per_position[3]
    )
    assert stats.running_requests == 0 and stats.kv_cache_bytes == 0
    metrics = ngram.metrics()
    assert metrics["vllm:spec_decode_num_drafts_total"] == spec.drafts
    assert metrics["vllm:spec_decode_num_accepted_tokens_total"] == spec.accepted_tokens


async def test_the_dense_model_drafts_for_its_moe_twin(cores):
    off, _, draft = cores
    requests = [request(QUESTION, 16), request(CODE_EDIT, 24)]
    plain, _ = await generate(off, *requests)
    drafted, stats = await generate(draft, *requests)
    assert [tokens for tokens, _ in drafted] == [tokens for tokens, _ in plain]
    spec = stats.speculative
    assert spec.method.startswith("draft:") and len(spec.accepted_per_position) == 3
    assert spec.accepted_tokens > 0.8 * spec.draft_tokens  # the same function, computed another way


async def test_a_request_can_turn_speculation_off(cores):
    _, ngram, _ = cores
    _, before = await generate(ngram, request(QUESTION, 1))
    (result,), after = await generate(ngram, request(CODE_EDIT, 24, speculative=False))
    assert len(result[0]) == 24
    assert after.speculative.drafts == before.speculative.drafts


async def test_stop_strings_end_the_text_where_they_do_without_speculation(cores):
    off, ngram, _ = cores
    stopping = core_pb2.StoppingCriteria(max_tokens=40, stop=["height)"])
    stopped = core_pb2.GenerateRequest(prompt=CODE_EDIT, sampling=GREEDY, stopping=stopping)
    (want,), _ = await generate(off, stopped)
    (got,), _ = await generate(ngram, stopped)
    text = lambda chunks: "".join(c.text for c in chunks)  # noqa: E731
    assert text(got[1]) == text(want[1])
    assert got[1][-1].finish_reason == want[1][-1].finish_reason


def token_request(ids: list[int], max_tokens: int, **kwargs) -> core_pb2.GenerateRequest:
    stopping = core_pb2.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True)
    return core_pb2.GenerateRequest(
        token_ids=core_pb2.TokenIds(ids=ids), sampling=GREEDY, stopping=stopping, **kwargs
    )


async def test_a_prefix_cached_answer_resumes_midway_with_the_same_tokens(cores):
    """Two sequences drafted side by side (their KV slots realigned as they accept differently)
    go to the prefix cache when they finish; a follow-up sharing the start of an answer starts from
    a trimmed copy of it, which holds the right tokens only if the slots came back in order."""
    import mlx_lm

    off, ngram, _ = cores
    _, tokenizer = mlx_lm.load(str(ensure_demo_model(progress=False)), lazy=True)
    prompts = [tokenizer.encode(CODE_EDIT), tokenizer.encode(QUESTION)]
    first, _ = await generate(ngram, *(token_request(p, 32) for p in prompts))
    follow_ups = [
        token_request(p + answer[:4] + tokenizer.encode(" Then"), 12)
        for p, (answer, _) in zip(prompts, first, strict=True)
    ]
    want, _ = await generate(off, *follow_ups)
    for follow_up, (want_tokens, _) in zip(follow_ups, want, strict=True):
        (got,), _ = await generate(ngram, follow_up)  # one at a time: each starts from its cached prefix
        tokens, chunks = got
        assert tokens == want_tokens
        assert chunks[-1].usage.cached_prompt_tokens >= len(follow_up.token_ids.ids) - 3


async def test_constrained_and_seeded_requests_behave_as_without_speculation(cores):
    off, ngram, _ = cores
    schema = {"type": "object", "properties": {"colours": {"type": "array", "items": {"type": "string"}}}}
    constrained = request(QUESTION, 24, logprobs=True, top_logprobs=2)
    constrained.response_format.type = core_pb2.ResponseFormat.JSON_SCHEMA
    constrained.response_format.schema_json = json.dumps(schema)
    (want,), _ = await generate(off, constrained)
    _, before = await generate(ngram)
    (got,), after = await generate(ngram, constrained)
    assert got[0] == want[0]
    assert after.speculative.drafts > before.speculative.drafts  # the grammar's row drafted
    got_lp = [lp for chunk in got[1] for lp in chunk.logprobs]
    want_lp = [lp for chunk in want[1] for lp in chunk.logprobs]
    assert [lp.token_id for lp in got_lp] == got[0]
    for a, b in zip(got_lp, want_lp, strict=True):
        assert abs(a.logprob - b.logprob) < 1e-3 and len(a.top) == 2
    seeded = core_pb2.GenerateRequest(
        prompt=CODE_EDIT,
        sampling=core_pb2.SamplingParams(temperature=0.7, seed=11),
        stopping=core_pb2.StoppingCriteria(max_tokens=24, ignore_eos=True),
    )
    (once,), _ = await generate(ngram, seeded)
    (again,), _ = await generate(ngram, seeded)
    assert once[0] == again[0] and len(once[0]) == 24


async def test_a_cancelled_drafting_request_frees_its_sequence(cores):
    _, ngram, _ = cores
    async with grpc.aio.insecure_channel(ngram.address) as channel:
        stub = core_pb2_grpc.CoreStub(channel)
        call = stub.Generate(request(CODE_EDIT, 200), timeout=600)
        async for _ in call:
            break
        call.cancel()
        stats = await wait_idle(stub)
    assert (stats.running_requests, stats.kv_cache_bytes) == (0, 0)
