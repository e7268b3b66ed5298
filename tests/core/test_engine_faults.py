"""A fault anywhere in the engine's loop ends the requests it touches with an error and leaves
core serving; a fault the loop cannot recover from ends the process (`Engine.on_fatal`), so no
request waits for an engine thread that is gone."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import mlx.core as mx
import pytest

from services.core.engine_config import EngineConfig
from services.core.expert_link.local_spec import LocalExpertsSpec
from services.core.sequence import EngineError
from services.core.server import build_engine
from services.proto.moemesh.v1 import core_pb2

pytestmark = pytest.mark.slow  # loads a model and decodes

REQUEST = core_pb2.GenerateRequest(
    token_ids=core_pb2.TokenIds(ids=[3, 17, 42, 7, 99, 5]),
    sampling=core_pb2.SamplingParams(temperature=0),
    stopping=core_pb2.StoppingCriteria(max_tokens=6, ignore_eos=True),
)


@pytest.fixture
def served(tiny_models):
    engine, preparer, _ = build_engine(
        tiny_models.split("qwen3_moe", None),
        [],
        EngineConfig(idle_probe_s=0.2),
        local_experts=LocalExpertsSpec("all"),
    )
    engine.start()
    engine.loaded.wait()
    assert engine.load_error is None
    yield engine, preparer
    engine.stop()


def generate(engine, preparer) -> list[int] | EngineError:
    """The request's tokens, or the error it ended with; never waits more than 30 s."""

    async def run():
        loop, out = asyncio.get_running_loop(), asyncio.Queue()
        engine.submit(preparer.prepare(REQUEST, None), out, loop)
        ids = []
        while True:
            chunk = await asyncio.wait_for(out.get(), 30)
            if isinstance(chunk, EngineError):
                return chunk
            ids += list(chunk.token_ids)
            if chunk.finish_reason:
                return ids

    return asyncio.run(run())


class FailsOnce:
    """Stands in for a callable: raises the first time, then calls through."""

    def __init__(self, real, error: Exception):
        self.real, self.error, self.raised = real, error, False

    def __call__(self, *args, **kwargs):
        if not self.raised:
            self.raised = True
            raise self.error
        return self.real(*args, **kwargs)


def test_a_fault_outside_the_forwards_fails_its_requests_and_core_serves_on(served):
    """Delivering a step's tokens raises (as a collective that failed under MLX's lazy
    evaluation can, once its result is read): the request ends with an error at once, its
    place is freed, and the next request gets the same tokens as before the fault."""
    engine, preparer = served
    want = generate(engine, preparer)
    assert isinstance(want, list) and len(want) == 6
    engine.output.deliver = FailsOnce(engine.output.deliver, RuntimeError("a broken read"))
    failed = generate(engine, preparer)
    assert isinstance(failed, EngineError), failed
    assert failed.code == grpc.StatusCode.INTERNAL and "a broken read" in failed.message
    assert generate(engine, preparer) == want
    assert engine.running == 0 and engine.waiting == 0


def test_a_failed_steps_error_raised_again_while_freeing_memory_leaves_core_serving(served, monkeypatch):
    """MLX re-raises a failed evaluation's error where it next waits on the stream (a ring
    collective that lost a member raises again from `mx.clear_cache`): the request still ends with
    the step's error, and core serves the next one as before."""
    engine, preparer = served
    want = generate(engine, preparer)
    delivery = engine.output.deliver = FailsOnce(
        engine.output.deliver, RuntimeError("[ring] connection to a peer was lost")
    )
    clear_cache, raised_again = mx.clear_cache, []

    def clear_cache_after_the_fault() -> None:  # a step may clear MLX's cache before it fails too
        if delivery.raised and not raised_again:
            raised_again.append(True)
            raise RuntimeError("[ring] the same, again")
        clear_cache()

    monkeypatch.setattr(mx, "clear_cache", clear_cache_after_the_fault)
    failed = generate(engine, preparer)
    assert isinstance(failed, EngineError) and "connection to a peer was lost" in failed.message, failed
    assert raised_again
    assert generate(engine, preparer) == want
    assert engine.running == 0 and engine.waiting == 0


def test_an_engine_thread_that_dies_says_so_instead_of_leaving_requests_waiting(served):
    """Even failing the step's requests fails: the thread ends through `on_fatal`, which the
    server turns into an exit for its supervisor."""
    engine, preparer = served
    died = threading.Event()
    engine.on_fatal = lambda error: died.set()
    engine.output.deliver = FailsOnce(engine.output.deliver, RuntimeError("a broken read"))
    engine.step_failure = FailsOnce(engine.step_failure, RuntimeError("and a broken recovery"))

    async def submit():
        engine.submit(preparer.prepare(REQUEST, None), asyncio.Queue(), asyncio.get_running_loop())

    asyncio.run(submit())
    assert died.wait(30), "the engine thread neither recovered nor reported its death"


def test_a_probe_that_raises_is_reported_as_a_problem_and_service_resumes(served):
    """Looking at the workers fails (the I/O loop gone, say): core says it is not serving and why,
    refuses requests UNAVAILABLE meanwhile, and serves again once a look succeeds."""
    engine, preparer = served
    want = generate(engine, preparer)
    health: list[bool] = []
    engine.on_health(health.append)
    working = engine.probe_workers

    def broken():
        raise RuntimeError("no answer from the I/O loop")

    engine.probe_workers = broken
    deadline = time.monotonic() + 10
    while health[-1:] != [False]:
        assert time.monotonic() < deadline, "the failing probe was never reported"
        time.sleep(0.05)
    assert "no answer from the I/O loop" in " ".join(engine.problems)
    refused = generate(engine, preparer)
    assert isinstance(refused, EngineError) and refused.code == grpc.StatusCode.UNAVAILABLE, refused
    engine.probe_workers = working
    while health[-1:] != [True]:
        assert time.monotonic() < deadline, "service never resumed"
        time.sleep(0.05)
    assert generate(engine, preparer) == want
