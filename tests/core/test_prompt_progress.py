"""Core's prompt-token counter follows a prefill as it is computed, chunk by chunk, so the stats line
and the status page show a long prompt's progress instead of one jump at admission. In-process: the
real engine over a tiny mlx-lm model, with 16-token prefill chunks."""

from __future__ import annotations

import asyncio

import mlx_lm

from services.core.engine import Engine, EngineConfig
from services.core.request_prep import RequestPreparer
from services.core.sequence import EngineError
from services.proto.moemesh.v1 import core_pb2


class RecordingEngine(Engine):
    """The engine, recording its prompt-token counter after every step."""

    def _step(self) -> None:
        super()._step()
        self.after_steps.append(self.counters.prompt_tokens)


async def test_the_prompt_counter_grows_with_each_prefill_chunk(tiny_models):
    model, tokenizer = mlx_lm.load(str(tiny_models.checkpoint("qwen3_moe", None)))
    engine = RecordingEngine(
        tokenizer, EngineConfig(max_num_batched_tokens=16, prefix_cache_bytes=0), lambda: (model, list, None)
    )
    engine.after_steps = []
    engine.start()
    try:
        assert engine.loaded.wait(60) and engine.load_error is None
        prompt = [(7 * i) % 500 + 10 for i in range(100)]
        request = core_pb2.GenerateRequest(
            token_ids=core_pb2.TokenIds(ids=prompt), stopping=core_pb2.StoppingCriteria(max_tokens=2)
        )
        prepared = RequestPreparer(tokenizer, "tiny", 4096, model.args.vocab_size).prepare(request, None)
        out: asyncio.Queue = asyncio.Queue()
        engine.submit(prepared, out, asyncio.get_running_loop())
        while True:
            item = await asyncio.wait_for(out.get(), 60)
            if isinstance(item, EngineError) or item.finish_reason:
                break
    finally:
        engine.stop()
    assert not isinstance(item, EngineError), item.message
    during_prefill = [n for n in engine.after_steps if n < len(prompt)]
    assert len(set(during_prefill)) >= 5, engine.after_steps  # 100 tokens in chunks of at most 16
    assert during_prefill == sorted(during_prefill)
    assert engine.counters.prompt_tokens == len(prompt)
