"""The Core gRPC service as a real process over real expert worker processes."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import mlx.core as mx
import mlx_lm
import pytest
from grpc_health.v1 import health_pb2
from mlx_lm.generate import generate_step

from services.proto.moemesh.v1 import core_pb2, core_pb2_grpc
from tests.helpers import Workers, core_args, health_status, short_dir, spawn, stop, wait_serving

pytestmark = pytest.mark.slow  # starts processes or computes for seconds

GREEDY = core_pb2.SamplingParams(temperature=0)


class Stack:
    def __init__(self, split: Path, workdir: Path):
        self.workdir = workdir
        self.workers = Workers(split, workdir, ["0-3", "4-7"])
        self.core_address = f"unix:{workdir / 'core.sock'}"
        self.core_log = workdir / "core.log"
        self.core = spawn(
            core_args(split, self.core_address, self.workers.addresses, "--expert-timeout", "10"),
            self.core_log,
        )

    def channel(self) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(self.core_address)


@pytest.fixture(scope="module")
def stack(tiny_models):
    workdir = short_dir()
    stack = Stack(tiny_models.split("qwen3_moe", None), workdir)
    yield stack
    stop([stack.core])
    stack.workers.stop()


async def health(stack) -> int:
    async with stack.channel() as channel:
        return await health_status(channel)


async def generate(
    stack, request: core_pb2.GenerateRequest, timeout: float = 60
) -> list[core_pb2.GenerateChunk]:
    async with stack.channel() as channel:
        return [chunk async for chunk in core_pb2_grpc.CoreStub(channel).Generate(request, timeout=timeout)]


def tokens_of(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


async def wait_health(stack, status, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await health(stack) == status:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"core health never became {status}: {stack.core_log.read_text()[-2000:]}")


async def test_not_serving_until_every_expert_is_reachable(stack):
    """Runs first: the workers are not started yet."""
    await wait_health(stack, health_pb2.HealthCheckResponse.NOT_SERVING)
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await generate(
            stack, core_pb2.GenerateRequest(prompt="hi", stopping=core_pb2.StoppingCriteria(max_tokens=2))
        )
    assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
    stack.workers.start()
    await wait_health(stack, health_pb2.HealthCheckResponse.SERVING)


async def test_greedy_stream_matches_mlx_lm(stack, tiny_models):
    model, tokenizer = mlx_lm.load(str(tiny_models.checkpoint("qwen3_moe", None)))
    prompt = tokenizer.encode("Once upon a time")
    want = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=20)]
    chunks = await generate(
        stack,
        core_pb2.GenerateRequest(
            token_ids=core_pb2.TokenIds(ids=prompt),
            sampling=GREEDY,
            stopping=core_pb2.StoppingCriteria(max_tokens=20, ignore_eos=True),
        ),
    )
    assert tokens_of(chunks) == want
    assert len(chunks) == 20 and chunks[-1].finish_reason == core_pb2.FinishReason.LENGTH
    assert chunks[-1].usage.prompt_tokens == len(prompt) and chunks[-1].usage.completion_tokens == 20
    assert "".join(c.text for c in chunks) == tokenizer.decode(want)


async def test_batched_requests_each_match_their_solo_run(stack):
    prompts = ["Hello", "The weather today is", "1 2 3 4 5 6 7 8"]

    def request(p):
        return core_pb2.GenerateRequest(
            prompt=p, sampling=GREEDY, stopping=core_pb2.StoppingCriteria(max_tokens=12, ignore_eos=True)
        )

    solo = [tokens_of(await generate(stack, request(p))) for p in prompts]
    together = await asyncio.gather(*(generate(stack, request(p)) for p in prompts))
    assert [tokens_of(c) for c in together] == solo


async def test_seeded_sampling_is_reproducible(stack):
    request = core_pb2.GenerateRequest(
        prompt="Seeds",
        sampling=core_pb2.SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234),
        stopping=core_pb2.StoppingCriteria(max_tokens=10, ignore_eos=True),
    )
    first, second = tokens_of(await generate(stack, request)), tokens_of(await generate(stack, request))
    assert first == second
    request.sampling.seed = 99
    assert tokens_of(await generate(stack, request)) != first


async def test_stop_string_is_cut_and_never_sent(stack):
    base = core_pb2.GenerateRequest(
        prompt="Stop", sampling=GREEDY, stopping=core_pb2.StoppingCriteria(max_tokens=16, ignore_eos=True)
    )
    text = "".join(c.text for c in await generate(stack, base))
    stop_string = text[len(text) // 2 : len(text) // 2 + 3]
    base.stopping.stop.append(stop_string)
    chunks = await generate(stack, base)
    got = "".join(c.text for c in chunks)
    assert got == text[: text.find(stop_string)]
    assert chunks[-1].finish_reason == core_pb2.FinishReason.STOP


@pytest.mark.parametrize(
    "request_, code, words",
    [
        (
            core_pb2.GenerateRequest(prompt="x", stopping=core_pb2.StoppingCriteria(max_tokens=100000)),
            "INVALID_ARGUMENT",
            "context_length_exceeded",
        ),
        (core_pb2.GenerateRequest(prompt="x", model="gpt-4"), "NOT_FOUND", "gpt-4"),
        (core_pb2.GenerateRequest(chat=core_pb2.ChatInput()), "INVALID_ARGUMENT", "chat.messages"),
        (core_pb2.GenerateRequest(), "INVALID_ARGUMENT", "input"),
        (
            core_pb2.GenerateRequest(token_ids=core_pb2.TokenIds(ids=[10**7])),
            "INVALID_ARGUMENT",
            "vocabulary",
        ),
        (
            core_pb2.GenerateRequest(prompt="x", sampling=core_pb2.SamplingParams(top_p=1.5)),
            "INVALID_ARGUMENT",
            "top_p",
        ),
        (
            core_pb2.GenerateRequest(
                chat=core_pb2.ChatInput(messages=[core_pb2.ChatMessage(role="wizard", content="x")])
            ),
            "INVALID_ARGUMENT",
            "role",
        ),
        # NaN compares false with any bound: without explicit checks it samples garbage
        (
            core_pb2.GenerateRequest(prompt="x", sampling=core_pb2.SamplingParams(temperature=float("nan"))),
            "INVALID_ARGUMENT",
            "temperature",
        ),
        (
            core_pb2.GenerateRequest(
                prompt="x", sampling=core_pb2.SamplingParams(repetition_penalty=float("nan"))
            ),
            "INVALID_ARGUMENT",
            "repetition_penalty",
        ),
        (core_pb2.GenerateRequest(prompt="x", request_id="r" * 100_000), "INVALID_ARGUMENT", "request_id"),
        # text that cannot fit the context is refused before the tokenizer spends seconds on it
        (core_pb2.GenerateRequest(prompt="x " * 400_000), "INVALID_ARGUMENT", "context_length_exceeded"),
    ],
)
async def test_bad_requests_get_precise_status(stack, request_, code, words):
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await generate(stack, request_)
    assert failure.value.code().name == code and words in failure.value.details()


async def test_count_tokens_counts_text_of_any_length(stack):
    """Counting is how a client learns a text is too long for the context, so it counts text that
    generating would refuse; the chat template's tokens are counted the same way."""
    async with stack.channel() as channel:
        stub = core_pb2_grpc.CoreStub(channel)
        assert (await stub.CountTokens(core_pb2.CountTokensRequest(prompt="one two three"))).count == 3
        long_text = " ".join(["one two three"] * 100_000)  # far past the context; generating refuses it
        assert (await stub.CountTokens(core_pb2.CountTokensRequest(prompt=long_text))).count == 300_000
        message = core_pb2.ChatMessage(role="user", content=long_text)
        chat = core_pb2.ChatInput(messages=[message], add_generation_prompt=True)
        assert (await stub.CountTokens(core_pb2.CountTokensRequest(chat=chat))).count > 300_000
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await generate(stack, core_pb2.GenerateRequest(prompt=long_text))
        assert "context_length_exceeded" in failure.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await stub.CountTokens(core_pb2.CountTokensRequest())
        assert failure.value.details() == "input: one of chat, prompt is required"


async def test_bytes_that_do_not_parse_are_invalid_argument_and_harm_nothing(stack):
    """grpcio alone answers UNKNOWN ("Unexpected DecodeError"), as if core had failed."""
    garbage = b"\xff\xff\xff\x07not a message"
    async with stack.channel() as channel:
        for method, call in (
            ("Generate", channel.unary_stream("/moemesh.v1.Core/Generate")),
            ("CountTokens", channel.unary_unary("/moemesh.v1.Core/CountTokens")),
            ("Detokenize", channel.unary_unary("/moemesh.v1.Core/Detokenize")),
            ("GetStats", channel.unary_unary("/moemesh.v1.Core/GetStats")),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as failure:
                reply = call(garbage, timeout=30)
                if method == "Generate":
                    [chunk async for chunk in reply]
                else:
                    await reply
            assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
            assert "does not parse" in failure.value.details(), method
    request = core_pb2.GenerateRequest(prompt="hi", stopping=core_pb2.StoppingCriteria(max_tokens=3))
    assert len(tokens_of(await generate(stack, request))) == 3


async def test_cancel_frees_the_sequence(stack):
    async with stack.channel() as channel:
        stub = core_pb2_grpc.CoreStub(channel)
        call = stub.Generate(
            core_pb2.GenerateRequest(
                prompt="Long",
                sampling=GREEDY,
                stopping=core_pb2.StoppingCriteria(max_tokens=3000, ignore_eos=True),
            ),
            timeout=60,
        )
        await call.read()
        await call.read()
        assert (await stub.GetStats(core_pb2.GetStatsRequest())).running_requests == 1
        call.cancel()
        for _ in range(100):
            if (await stub.GetStats(core_pb2.GetStatsRequest())).running_requests == 0:
                break
            await asyncio.sleep(0.05)
        assert (await stub.GetStats(core_pb2.GetStatsRequest())).running_requests == 0


async def test_worker_killed_mid_generation_fails_fast_then_core_recovers(stack):
    request = core_pb2.GenerateRequest(
        prompt="Keep going",
        sampling=GREEDY,
        stopping=core_pb2.StoppingCriteria(max_tokens=3000, ignore_eos=True),
    )
    async with stack.channel() as channel:
        stub = core_pb2_grpc.CoreStub(channel)
        call = stub.Generate(request, timeout=30)
        for _ in range(3):
            await call.read()
        stack.workers.kill(1)
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            while (await call.read()) is not grpc.aio.EOF:
                pass
        assert time.monotonic() - started < 10
        assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
        assert stack.workers.addresses[1].removeprefix("unix:") in failure.value.details()
        assert stack.core.poll() is None, "core must stay up"
        await wait_health(stack, health_pb2.HealthCheckResponse.NOT_SERVING)
        assert (await stub.GetStats(core_pb2.GetStatsRequest())).running_requests == 0

    stack.workers.start(1)
    await wait_health(stack, health_pb2.HealthCheckResponse.SERVING)
    request.stopping.max_tokens = 5
    assert len(tokens_of(await generate(stack, request))) == 5


async def test_hung_worker_fails_the_request_within_the_call_timeout(stack):
    """A worker that stops answering (SIGSTOP) must not hang the request: core gives up after its
    --expert-timeout (10 s here) with UNAVAILABLE naming the worker, and recovers after SIGCONT."""
    import signal

    request = core_pb2.GenerateRequest(
        prompt="Hang", sampling=GREEDY, stopping=core_pb2.StoppingCriteria(max_tokens=50, ignore_eos=True)
    )
    worker = stack.workers.ensure_running().procs[0]
    await wait_health(stack, health_pb2.HealthCheckResponse.SERVING)
    worker.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await generate(stack, request, timeout=60)
        assert time.monotonic() - started < 30
        assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "did not answer" in failure.value.details()
        assert stack.workers.addresses[0].removeprefix("unix:") in failure.value.details()
    finally:
        worker.send_signal(signal.SIGCONT)
    await wait_health(stack, health_pb2.HealthCheckResponse.SERVING)
    request.stopping.max_tokens = 3
    assert len(tokens_of(await generate(stack, request))) == 3


async def test_overflow_is_refused_with_resource_exhausted(stack, tiny_models):
    """A core with room for two running sequences and one waiting: a prompt still being prefilled
    takes a place as a decoding sequence does (mlx-lm's generator alone would admit another), the
    third request waits, the fourth is refused at once."""
    stack.workers.ensure_running()
    address = f"unix:{stack.workdir / 'small-core.sock'}"
    log = stack.workdir / "small-core.log"
    split = tiny_models.split("qwen3_moe", None)
    small = spawn(
        core_args(
            split,
            address,
            stack.workers.addresses,
            *("--max-num-seqs", "2", "--max-queue", "1", "--max-num-batched-tokens", "8"),
        ),
        log,
    )
    try:
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: wait_serving(address, small, log_path=log)
        )

        def busy(prompt: str, max_tokens: int = 2000) -> core_pb2.GenerateRequest:
            return core_pb2.GenerateRequest(
                prompt=prompt,
                sampling=GREEDY,
                stopping=core_pb2.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
            )

        async with grpc.aio.insecure_channel(address) as channel:
            stub = core_pb2_grpc.CoreStub(channel)

            async def stats() -> core_pb2.CoreStats:
                return await stub.GetStats(core_pb2.GetStatsRequest())

            first = stub.Generate(busy("Busy"), timeout=60)
            await first.read()  # decoding
            # ~3,300 prompt tokens at 7 a step: prefilling for hundreds of steps
            second = stub.Generate(busy("one two three four five six " * 550, max_tokens=500), timeout=60)
            reads = [asyncio.ensure_future(second.read())]  # make sure the call is really sent
            for _ in range(200):
                if (await stats()).running_requests == 2:
                    break
                await asyncio.sleep(0.05)
            third = stub.Generate(busy("Busy"), timeout=60)
            reads.append(asyncio.ensure_future(third.read()))
            seen = []
            for _ in range(20):  # ~1 s of steps while the second is still prefilling
                seen.append(await stats())
                await asyncio.sleep(0.05)
            assert max(s.running_requests for s in seen) == 2, seen
            assert (seen[-1].running_requests, seen[-1].waiting_requests) == (2, 1), seen
            assert not reads[0].done()  # the second was prefilling all along
            with pytest.raises(grpc.aio.AioRpcError) as failure:
                async for _ in stub.Generate(busy("Busy"), timeout=10):
                    pass
            assert failure.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            for call in (first, second, third, *reads):
                call.cancel()
            for _ in range(100):
                stats_now = await stats()
                if stats_now.running_requests == 0 and stats_now.waiting_requests == 0:
                    break
                await asyncio.sleep(0.05)
            assert (stats_now.running_requests, stats_now.waiting_requests, stats_now.kv_cache_bytes) == (
                0,
                0,
                0,
            )
    finally:
        stop([small])
