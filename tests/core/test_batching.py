"""Continuous batching and prefix caching, checked on the demo model through real processes.

The demo model checks that batching changes no token; a tiny qwen3_moe (fast to prefill on a
CPU) checks chunked prefill and prefix reuse, where one pair of expert workers serves two cores:
one with the prefix cache off (the reference) and one with it on.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from pathlib import Path

import grpc
import httpx
import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step
from prometheus_client.parser import text_string_to_metric_families

from services.common.manifest import Manifest
from services.core.sampling import make_sampler
from services.ops.up import resolve_split
from services.proto.moemesh.v1 import core_pb2, core_pb2_grpc
from services.tools.demo_model import ensure_demo_model
from tests.helpers import Workers, core_args, free_port, short_dir, spawn, stop, wait_serving

pytestmark = pytest.mark.slow  # starts processes or computes for seconds

GREEDY = core_pb2.SamplingParams(temperature=0)
QUESTIONS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "How many legs does a spider have?",
    "Write a haiku about the sea.",
    "What is two plus two?",
    "Who wrote Romeo and Juliet?",
    "Give me a synonym for happy.",
    "What is the boiling point of water?",
    "Translate 'hello' into Spanish.",
    "What planet is known as the red planet?",
    "List two prime numbers.",
    "What do bees make?",
    "Describe a cat in one sentence.",
    "What is the opposite of cold?",
    "Which ocean is the largest?",
    "Say something kind.",
]
# A long, fixed system prompt (well over 1K tokens) shared by requests in the prefix-cache test.
SYSTEM_PROMPT = "You are a careful assistant. " + " ".join(
    f"Rule {i}: answer politely, cite facts you are sure of, and keep rule {i} in mind." for i in range(90)
)


class Core:
    def __init__(self, split: Path, workers: Workers, workdir: Path, name: str, extra: list[str]):
        self.address = f"unix:{workdir / f'{name}.sock'}"
        self.log = workdir / f"{name}.log"
        self.metrics_port = free_port()
        self.proc = spawn(
            core_args(
                split, self.address, workers.addresses, "--metrics-port", str(self.metrics_port), *extra
            ),
            self.log,
        )

    def metrics(self) -> dict[str, float]:
        """Prometheus samples by name{labels}."""
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text
        return {
            f"{s.name}{sorted(s.labels.items()) if s.labels else ''}": s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def wait(self) -> None:
        wait_serving(self.address, self.proc, timeout_s=300, log_path=self.log)


def start_cores(split: Path, configs: dict[str, list[str]]) -> tuple[Workers, dict[str, Core]]:
    workdir = short_dir()
    workers = Workers(split, workdir, ["0-3", "4-7"]).start()
    cores = {name: Core(split, workers, workdir, name, extra) for name, extra in configs.items()}
    return workers, cores


@contextlib.contextmanager
def running(split: Path, configs: dict[str, list[str]]):
    workers, cores = start_cores(split, configs)
    try:
        for core in cores.values():
            core.wait()
        yield cores
    finally:
        stop([core.proc for core in cores.values()])
        workers.stop()


@pytest.fixture(scope="module")
def demo_cores():
    """The demo model (real weights: greedy margins are real, not random-weight ties), served
    by a core with one batch and one with two micro-batches in ping-pong, over the same workers."""
    configs = {
        "plain": ["--prefix-cache-gb", "0"],
        "pingpong": ["--prefix-cache-gb", "0", "--micro-batches", "2"],
    }
    with running(resolve_split(None), configs) as cores:
        yield cores


@pytest.fixture(scope="module")
def demo_core(demo_cores):
    return demo_cores["plain"]


@pytest.fixture(scope="module")
def tiny_cores(tiny_models):
    """A tiny qwen3_moe with the real Qwen3 tokenizer: long prompts prefill in seconds on a CPU
    (the demo model's 2K-token prefill takes minutes here). The core with the prefix cache also
    runs two micro-batches, so prefix reuse and prompt scoring are checked across them."""
    configs = {
        "plain": ["--prefix-cache-gb", "0", "--max-num-batched-tokens", "64"],
        "cached": ["--prefix-cache-gb", "1", "--max-num-batched-tokens", "64", "--micro-batches", "2"],
    }
    with running(tiny_models.split("qwen3_moe", None), configs) as cores:
        yield cores["plain"], cores["cached"]


def chat(question: str, system: str | None = None, **kwargs) -> core_pb2.GenerateRequest:
    messages = [core_pb2.ChatMessage(role="system", content=system)] if system else []
    messages.append(core_pb2.ChatMessage(role="user", content=question))
    return core_pb2.GenerateRequest(
        chat=core_pb2.ChatInput(messages=messages, add_generation_prompt=True), **kwargs
    )


async def wait_idle(stub, seconds: float = 10.0) -> core_pb2.CoreStats:
    """Core's stats once nothing runs and no KV is held, or the last seen after `seconds`."""
    for _ in range(int(seconds / 0.1)):
        stats = await stub.GetStats(core_pb2.GetStatsRequest())
        if stats.running_requests == 0 and stats.kv_cache_bytes == 0:
            break
        await asyncio.sleep(0.1)
    return stats


async def run(stub, request) -> tuple[list[int], list]:
    tokens, chunks = [], []
    async for chunk in stub.Generate(request, timeout=600):
        tokens.extend(chunk.token_ids)
        chunks.append(chunk)
    return tokens, chunks


def requests_for_batch() -> list[core_pb2.GenerateRequest]:
    """Greedy requests plus a few seeded sampling ones, with different prompt and output lengths.
    Plain prompts, not chat: short prompts keep sixteen solo runs quick on a CPU."""
    out = []
    for i, question in enumerate(QUESTIONS):
        sampling = GREEDY if i % 4 else core_pb2.SamplingParams(temperature=0.9, top_p=0.95, seed=1000 + i)
        stopping = core_pb2.StoppingCriteria(max_tokens=4 + i % 3, ignore_eos=True)
        out.append(
            core_pb2.GenerateRequest(prompt=f"Q: {question}\nA:", sampling=sampling, stopping=stopping)
        )
    return out


def run_alone_with_mlx_lm(requests: list[core_pb2.GenerateRequest]) -> list[list[int]]:
    """Each request on its own through mlx-lm's `generate_step` on the unsplit demo model, with
    core's own per-request sampler (same seed chain): the oracle for "the same request run alone"."""
    model, tokenizer = mlx_lm.load(str(ensure_demo_model()))
    out = []
    for request in requests:
        sampler = make_sampler(request.sampling, model.args.vocab_size)
        prompt = mx.array(tokenizer.encode(request.prompt))
        steps = generate_step(prompt, model, sampler=sampler, max_tokens=request.stopping.max_tokens)
        out.append([int(token) for token, _ in steps])
    return out


@functools.cache
def demo_tokens_alone() -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(tokens) for tokens in run_alone_with_mlx_lm(requests_for_batch()))


@pytest.mark.parametrize("name", ["plain", "pingpong"])
async def test_sixteen_concurrent_requests_match_each_run_alone(demo_cores, name):
    core = demo_cores[name]
    requests = requests_for_batch()
    pipelined = "moe_mesh_expert_layer_calls_pipelined_total"
    before = core.metrics().get(pipelined, 0.0)
    async with grpc.aio.insecure_channel(core.address) as channel:
        stub = core_pb2_grpc.CoreStub(channel)
        batch = await asyncio.gather(*(run(stub, r) for r in requests))
        stats = await wait_idle(stub)
    alone = demo_tokens_alone()
    for i, ((batched_tokens, _), alone_tokens) in enumerate(zip(batch, alone, strict=True)):
        assert batched_tokens == list(alone_tokens), f"request {i} ({QUESTIONS[i]!r}) differs when batched"
        assert len(alone_tokens) == 4 + i % 3
    assert stats.running_requests == 0 and stats.waiting_requests == 0 and stats.kv_cache_bytes == 0
    calls = core.metrics()[pipelined] - before
    # with two micro-batches, layer calls go out while the other batch's are computing
    assert calls > 0 if name == "pingpong" else calls == 0


async def test_a_request_behind_an_abandoned_long_prompt_starts_within_seconds(demo_core):
    """The QA scenario on the demo model, whose prefill costs ~75 ms a token on this CPU: a long
    prompt prefilling alone is shown as running (not waiting) from its first step, runs in chunks
    of a few seconds rather than one 512-token chunk (~40 s here), so a short request sent behind
    it starts at the next step boundary; a client that abandons the long prompt frees everything."""
    long_prompt = core_pb2.GenerateRequest(
        prompt=SYSTEM_PROMPT,  # ~1,500 tokens
        sampling=GREEDY,
        stopping=core_pb2.StoppingCriteria(max_tokens=1),
    )
    short = core_pb2.GenerateRequest(
        prompt="Q: What is two plus two?\nA:",
        sampling=GREEDY,
        stopping=core_pb2.StoppingCriteria(max_tokens=2),
    )
    async with grpc.aio.insecure_channel(demo_core.address) as channel:
        stub = core_pb2_grpc.CoreStub(channel)
        long_call = stub.Generate(long_prompt, timeout=600)
        long_read = asyncio.ensure_future(long_call.read())
        for _ in range(100):
            stats = await stub.GetStats(core_pb2.GetStatsRequest())
            if stats.running_requests + stats.waiting_requests:
                break  # admitted
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)  # its first step has started (and runs ~5 s on this CPU)
        stats = await stub.GetStats(core_pb2.GetStatsRequest())
        seen = (stats.running_requests, stats.waiting_requests)
        assert seen == (1, 0), f"the prefilling prompt is not counted as running: {seen}"
        tokens, chunks = await run(stub, short)
        assert not long_read.done(), "the long prompt finished first: the test measured nothing"
        long_call.cancel()
        for _ in range(100):
            stats = await stub.GetStats(core_pb2.GetStatsRequest())
            if stats.running_requests == 0 and stats.waiting_requests == 0 and stats.kv_cache_bytes == 0:
                break
            await asyncio.sleep(0.1)
    assert len(tokens) == 2
    # the short request waited for the step under way (a chunk of the long prompt), not for 512
    # tokens of it: the core's own clock, which counts no client or transport time
    queued = chunks[-1].timings.queue_seconds
    assert queued < 0.5 * 512 * 0.075, f"the short request waited {queued:.1f} s for its first step"
    assert (stats.running_requests, stats.waiting_requests, stats.kv_cache_bytes) == (0, 0, 0), stats


async def test_long_prompt_prefill_does_not_freeze_decoding_streams(tiny_cores, tiny_models):
    """Prefill is chunked by --max-num-batched-tokens (64 here) and interleaved with decode."""
    plain, _ = tiny_cores
    arrivals: dict[int, list[float]] = {i: [] for i in range(4)}

    async def stream(i: int, stub) -> None:
        request = chat(
            QUESTIONS[i],
            sampling=GREEDY,
            stopping=core_pb2.StoppingCriteria(max_tokens=4000, ignore_eos=True),
        )
        async for chunk in stub.Generate(request, timeout=600):
            arrivals[i].extend([time.monotonic()] * len(chunk.token_ids))

    before = plain.metrics()
    async with grpc.aio.insecure_channel(plain.address) as channel:
        stub = core_pb2_grpc.CoreStub(channel)
        streams = [asyncio.create_task(stream(i, stub)) for i in range(4)]
        while min(len(a) for a in arrivals.values()) < 2:
            await asyncio.sleep(0.05)
        long_request = chat(SYSTEM_PROMPT, sampling=GREEDY, stopping=core_pb2.StoppingCriteria(max_tokens=1))
        submitted = time.monotonic()
        _, chunks = await run(stub, long_request)
        first_token = time.monotonic()
        prompt_tokens = chunks[-1].usage.prompt_tokens
        for task in streams:  # the client goes away: core must free these sequences
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        for _ in range(100):
            stats = await stub.GetStats(core_pb2.GetStatsRequest())
            if stats.running_requests == 0:
                break
            await asyncio.sleep(0.1)
    assert prompt_tokens > 1000
    steps_needed = prompt_tokens // 64
    for i, times in arrivals.items():
        during = [t for t in times if submitted < t < first_token]
        # Every prefill step also decodes the running streams; allow slack for scheduling.
        assert len(during) >= steps_needed // 2, (
            f"stream {i} got {len(during)} tokens during a {prompt_tokens}-token prefill"
        )
    assert stats.running_requests == 0, "cancelled streams still hold their place"

    # One expert call per worker per MoE layer per step, although most of these steps ran two
    # forwards (the streams' decode and a prefill chunk), some three (a prompt joining).
    after = plain.metrics()
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    moe_layers = len(Manifest.load(tiny_models.split("qwen3_moe", None)).layers)
    steps, forwards = delta["moe_mesh_engine_steps_total"], delta["moe_mesh_engine_forwards_total"]
    assert forwards >= 1.5 * steps, (steps, forwards)
    calls = {n: v for n, v in delta.items() if n.startswith("moe_mesh_expert_worker_calls_total")}
    assert len(calls) == 2
    for worker, count in calls.items():
        assert steps * moe_layers * 0.9 <= count <= steps * moe_layers, (worker, count, steps)


@pytest.mark.parametrize("kv_cache", ["fp16", "turboquant"])
async def test_shared_system_prompt_is_reused_and_output_unchanged(tiny_cores, kv_cache):
    plain, cached = tiny_cores
    first = chat(
        "What is the capital of France?",
        SYSTEM_PROMPT,
        sampling=GREEDY,
        stopping=core_pb2.StoppingCriteria(max_tokens=8),
        kv_cache=kv_cache,
    )
    second = chat(
        "Name a large ocean.",
        SYSTEM_PROMPT,
        sampling=GREEDY,
        stopping=core_pb2.StoppingCriteria(max_tokens=8),
        kv_cache=kv_cache,
    )
    async with grpc.aio.insecure_channel(cached.address) as channel:
        stub = core_pb2_grpc.CoreStub(channel)
        before = (await stub.GetStats(core_pb2.GetStatsRequest())).prefix_cache
        await run(stub, first)
        reused_tokens, reused_chunks = await run(stub, second)
        after = (await stub.GetStats(core_pb2.GetStatsRequest())).prefix_cache
    async with grpc.aio.insecure_channel(plain.address) as channel:
        cold_tokens, cold_chunks = await run(core_pb2_grpc.CoreStub(channel), second)
    assert reused_tokens == cold_tokens
    usage = reused_chunks[-1].usage
    assert usage.cached_prompt_tokens > 1000, usage
    assert usage.cached_prompt_tokens < usage.prompt_tokens
    assert cold_chunks[-1].usage.cached_prompt_tokens == 0
    assert after.hits >= before.hits + 1
    assert after.hit_tokens >= before.hit_tokens + usage.cached_prompt_tokens
    assert 0 < after.bytes <= after.budget_bytes


async def test_unknown_kv_cache_kind_is_invalid_argument(tiny_cores):
    plain, _ = tiny_cores
    async with grpc.aio.insecure_channel(plain.address) as channel:
        stub = core_pb2_grpc.CoreStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await run(stub, chat("hi", sampling=GREEDY, kv_cache="int3-magic"))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "kv_cache" in error.value.details()


async def test_core_reports_kv_bytes_in_use_and_turboquant_holds_fewer(tiny_cores):
    """GetStats.kv_cache_bytes covers the sequences in flight; a ~2K-token context costs fewer
    bytes compressed than in fp16, and nothing once the request is gone."""
    plain, _ = tiny_cores
    in_use = {}
    async with grpc.aio.insecure_channel(plain.address) as channel:
        stub = core_pb2_grpc.CoreStub(channel)
        for kind in ("fp16", "turboquant"):
            request = chat(
                SYSTEM_PROMPT,
                sampling=GREEDY,
                stopping=core_pb2.StoppingCriteria(max_tokens=1000, ignore_eos=True),
                kv_cache=kind,
            )
            call = stub.Generate(request, timeout=600)
            for _ in range(3):  # past prefill, decoding
                await call.read()
            in_use[kind] = (await stub.GetStats(core_pb2.GetStatsRequest())).kv_cache_bytes
            call.cancel()
        stats = await wait_idle(stub)
    assert in_use["fp16"] > 0 and 0 < in_use["turboquant"] < 0.7 * in_use["fp16"], in_use
    # no step runs after the last cancel: the cancel itself brings the gauges back to zero
    assert stats.running_requests == 0 and stats.kv_cache_bytes == 0, stats


async def test_fp16_and_turboquant_requests_batch_together_unchanged(tiny_cores):
    """Requests with different KV cache kinds run in one step (their expert calls merged) and
    give the tokens they give alone."""
    plain, _ = tiny_cores
    requests = [
        chat(
            question,
            sampling=GREEDY,
            stopping=core_pb2.StoppingCriteria(max_tokens=12, ignore_eos=True),
            kv_cache=kind,
        )
        for question, kind in zip(QUESTIONS[:4], ["fp16", "turboquant"] * 2, strict=True)
    ]
    async with grpc.aio.insecure_channel(plain.address) as channel:
        stub = core_pb2_grpc.CoreStub(channel)
        alone = [(await run(stub, request))[0] for request in requests]
        before = plain.metrics()
        together = await asyncio.gather(*(run(stub, request) for request in requests))
        after = plain.metrics()
    assert [tokens for tokens, _ in together] == alone
    steps = after["moe_mesh_engine_steps_total"] - before["moe_mesh_engine_steps_total"]
    forwards = after["moe_mesh_engine_forwards_total"] - before["moe_mesh_engine_forwards_total"]
    assert forwards > steps  # the kinds' forwards shared steps


def mlx_lm_prompt_logprobs(checkpoint: Path, prompt: list[int]) -> mx.array:
    """mlx-lm's own model over the whole prompt at once: row i scores prompt[i + 1]."""
    model, _ = mlx_lm.load(str(checkpoint))
    logits = model(mx.array(prompt)[None])[0].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


async def test_prompt_logprobs_match_mlx_lm_across_chunks_and_batches(tiny_cores, tiny_models):
    """Prompt logprobs (completions' echo + logprobs, vLLM's prompt_logprobs) score every prompt
    token as mlx-lm's model does over the whole prompt, though core prefills it in 64-token chunks
    beside other requests; the prefix cache, which holds the prompt, is not used for it; and with
    max_tokens 0 the scored prompt is the whole answer."""
    _, cached = tiny_cores
    tokenizer = mlx_lm.load(str(tiny_models.checkpoint("qwen3_moe", None)))[1]
    long_prompt = tokenizer.encode(SYSTEM_PROMPT[:700])  # ~150 tokens: three chunks
    short_prompt = tokenizer.encode("The capital of France is")
    assert len(long_prompt) > 2 * 64

    def scored(prompt: list[int], max_tokens: int) -> core_pb2.GenerateRequest:
        return core_pb2.GenerateRequest(
            token_ids=core_pb2.TokenIds(ids=prompt),
            sampling=GREEDY,
            stopping=core_pb2.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
            prompt_logprobs=True,
            top_logprobs=3,
        )

    async with grpc.aio.insecure_channel(cached.address) as channel:
        stub = core_pb2_grpc.CoreStub(channel)
        plain = core_pb2.GenerateRequest(token_ids=core_pb2.TokenIds(ids=long_prompt), sampling=GREEDY)
        plain.stopping.max_tokens = 2
        await run(stub, plain)  # the prefix cache now holds the long prompt
        results = await asyncio.gather(
            run(stub, scored(long_prompt, 4)),
            run(stub, scored(short_prompt, 0)),
            run(stub, chat("What is two plus two?", sampling=GREEDY, stopping=plain.stopping)),
        )
        stats = await stub.GetStats(core_pb2.GetStatsRequest())
    (long_tokens, long_chunks), (short_tokens, short_chunks), _ = results

    for prompt, chunks in ((long_prompt, long_chunks), (short_prompt, short_chunks)):
        entries = list(chunks[0].prompt_logprobs)
        assert [e.token_id for e in entries] == prompt
        assert entries[0].logprob == 0 and not entries[0].top  # nothing before the first token
        expected = mlx_lm_prompt_logprobs(tiny_models.checkpoint("qwen3_moe", None), prompt)
        want = mx.take_along_axis(expected[:-1], mx.array(prompt[1:])[:, None], axis=-1)[:, 0]
        assert mx.allclose(mx.array([e.logprob for e in entries[1:]]), want, atol=1e-4).item()
        best = mx.argsort(-expected[:-1], axis=-1)[:, :1].tolist()
        assert [[t.token_id for t in e.top][:1] for e in entries[1:]] == best
        assert all(len(e.top) == 3 and e.token_bytes for e in entries[1:])
        assert all(not chunk.prompt_logprobs for chunk in chunks[1:])
    assert long_chunks[-1].usage.cached_prompt_tokens == 0  # computed in full
    assert len(long_tokens) == 4
    # max_tokens 0: one chunk, the scored prompt and nothing generated
    assert short_tokens == [] and len(short_chunks) == 1
    assert short_chunks[0].finish_reason == core_pb2.FinishReason.LENGTH
    assert short_chunks[0].usage.completion_tokens == 0
    assert short_chunks[0].usage.prompt_tokens == len(short_prompt)
    assert stats.running_requests == 0 and stats.kv_cache_bytes == 0


async def test_max_tokens_zero_needs_prompt_logprobs(tiny_cores):
    plain, _ = tiny_cores
    async with grpc.aio.insecure_channel(plain.address) as channel:
        stub = core_pb2_grpc.CoreStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await run(stub, chat("hi", sampling=GREEDY, stopping=core_pb2.StoppingCriteria(max_tokens=0)))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens" in error.value.details()
