"""A burst of requests reaching an idle core shares one prefill step (services/core/inbox.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import grpc
import httpx
import mlx.core as mx
import mlx_lm
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.core.inbox import EngineInbox
from services.proto.moemesh.v1 import core_pb2_grpc
from tests.helpers import core_args, free_port, greedy_ids, spawn, stop, wait_serving


def add(prompt_tokens: int = 4) -> tuple[str, SimpleNamespace]:
    return ("add", SimpleNamespace(request=SimpleNamespace(prompt=[1] * prompt_tokens)))


def put_later(inbox: EngineInbox, items: list, every_s: float, after_s: float = 0.0) -> threading.Thread:
    def run():
        time.sleep(after_s)
        for item in items:
            inbox.put(item)
            time.sleep(every_s)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_without_gathering_a_take_is_what_already_arrived():
    inbox = EngineInbox(gather_gap_s=0.0)
    first, second = add(), add()
    inbox.put(first)
    inbox.put(second)
    late = put_later(inbox, [add()], every_s=0, after_s=0.05)
    assert inbox.take(timeout=1.0, gather=True) == [first, second]
    late.join()
    assert len(inbox.take(timeout=1.0)) == 1
    assert inbox.take(timeout=0.0) == []


def test_from_idle_requests_arriving_close_together_are_taken_together():
    inbox = EngineInbox(gather_gap_s=0.2)
    burst = [add() for _ in range(6)]
    sender = put_later(inbox, burst, every_s=0.01)
    assert inbox.take(timeout=5.0, gather=True) == burst
    sender.join()


def test_a_burst_ends_where_arrivals_pause():
    inbox = EngineInbox(gather_gap_s=0.05)
    burst, straggler = [add(), add()], add()
    sender = put_later(inbox, burst, every_s=0.005)
    later = put_later(inbox, [straggler], every_s=0, after_s=0.4)
    assert inbox.take(timeout=5.0, gather=True) == burst
    later.join()
    sender.join()
    assert inbox.take(timeout=1.0, gather=True) == [straggler]


def test_gathering_stops_once_one_step_is_full():
    inbox = EngineInbox(gather_gap_s=1.0, max_tokens=10, max_sequences=16)
    long_prompt = add(prompt_tokens=10)
    inbox.put(long_prompt)
    started = time.monotonic()
    assert inbox.take(timeout=1.0, gather=True) == [long_prompt]  # 10 tokens: the step is full
    assert time.monotonic() - started < 0.5
    inbox = EngineInbox(gather_gap_s=1.0, max_sequences=2)
    pair = [add(), add()]
    for item in pair:
        inbox.put(item)
    started = time.monotonic()
    assert inbox.take(timeout=1.0, gather=True) == pair
    assert time.monotonic() - started < 0.5


def test_arrivals_that_never_pause_still_start_within_the_window():
    inbox = EngineInbox(gather_gap_s=0.03)  # a window of ten gaps: 0.3 s
    stream = [add() for _ in range(200)]
    sender = put_later(inbox, stream, every_s=0.01)  # ~2 s of arrivals, never 30 ms apart
    started = time.monotonic()
    taken = inbox.take(timeout=5.0, gather=True)
    assert time.monotonic() - started < 1.0
    assert 2 <= len(taken) < len(stream) and taken == stream[: len(taken)]
    sender.join()


def test_a_cancel_or_a_busy_engine_does_not_wait_and_stop_wins():
    inbox = EngineInbox(gather_gap_s=1.0)
    cancel = ("cancel", SimpleNamespace())
    inbox.put(cancel)
    started = time.monotonic()
    assert inbox.take(timeout=1.0, gather=True) == [cancel]
    request = add()
    inbox.put(request)
    assert inbox.take(timeout=1.0, gather=False) == [request]
    assert time.monotonic() - started < 0.5
    inbox.put(add())
    inbox.put(None)
    assert inbox.take(timeout=1.0, gather=True) is None
    inbox.put(None)  # asked to stop while idle
    assert inbox.take(timeout=1.0, gather=True) is None
    with pytest.raises(ValueError, match="negative"):
        EngineInbox(gather_gap_s=-1.0)


def engine_steps(metrics_port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    return next(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "moe_mesh_engine_steps_total"
    )


@pytest.mark.slow
def test_a_burst_of_clients_is_prefilled_in_one_step_with_its_tokens_unchanged(tiny_models, short_tmp):
    """Six clients send at once to an idle core (a real process, gRPC): their prompts prefill
    together, in as many steps as one request alone takes, and each first token is mlx-lm's
    greedy token for that prompt alone."""
    arch = "qwen3_moe"
    split = tiny_models.split(arch, None)
    reference, tokenizer = mlx_lm.load(str(tiny_models.checkpoint(arch, None)))
    prompts = [tokenizer.encode(f"Tell me about the number {i}." + " And more." * i) for i in range(6)]
    want = [int(mx.argmax(reference(mx.array(p)[None])[0, -1]).item()) for p in prompts]
    address, metrics_port = f"unix:{short_tmp / 'core.sock'}", free_port()
    log_path = short_tmp / "core.log"
    flags = ["--burst-gather-ms", "300", "--metrics-port", str(metrics_port)]
    core = spawn(core_args(split, address, ["local"], *flags), log_path)

    async def clients() -> tuple[list[list[int]], float, float]:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = core_pb2_grpc.CoreStub(channel)

            def one(prompt: list[int]):
                return greedy_ids(stub, prompt, 1)

            await one(prompts[0])  # warm: the first request compiles and loads
            before = engine_steps(metrics_port)
            await one(prompts[1])
            alone = engine_steps(metrics_port) - before
            tokens = await asyncio.gather(*(one(p) for p in prompts))
            return tokens, alone, engine_steps(metrics_port) - before - alone

    try:
        wait_serving(address, core, log_path=log_path)
        tokens, alone, burst = asyncio.run(clients())
        assert tokens == [[w] for w in want]
        assert burst == alone, f"the burst took {burst} steps, one request alone {alone}"
    finally:
        stop([core])
