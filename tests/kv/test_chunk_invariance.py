"""A prompt's attention over a TurboQuant cache does not depend on how it was cut into prefill
chunks: each query sees what it would have seen had the prompt come one token at a time (the
chunks follow the clock and the batch, services/core/prefill_pacer.py). On CPUs, where the tests
run (cache.CHUNK_INVARIANT_PREFILL; GPUs keep one fused call over the runs as stored)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from services.core.kv import KVCacheSettings, TurboQuantKVCache, turboquant_attention
from services.core.kv import cache as cache_module

TOKENS = 45


def attention_by_chunks(settings: KVCacheSettings, chunks: list[int], seed: int = 3) -> mx.array:
    mx.random.seed(seed)
    keys = mx.random.normal((1, 2, TOKENS, 48)) * 3 + 1  # a common part, as real keys have
    values = mx.random.normal((1, 2, TOKENS, 48))
    queries = mx.random.normal((1, 6, TOKENS, 48))
    cache, outputs, start = TurboQuantKVCache(settings, layer=2), [], 0
    assert sum(chunks) == TOKENS
    for n in chunks:
        cache.update_and_fetch(keys[:, :, start : start + n], values[:, :, start : start + n])
        outputs.append(turboquant_attention(queries[:, :, start : start + n], cache, scale=0.2))
        start += n
    assert cache.compressed_length == 32  # 45 - 4 sinks - a window of 8..15: four blocks of 8
    return mx.concatenate(outputs, axis=2)


@pytest.mark.parametrize("centered", [False, True], ids=["plain", "centred"])
@pytest.mark.parametrize(
    "chunks",
    [[45], [13, 32], [5, 3, 37], [20, 7, 1, 17], [6] * 7 + [3]],
    ids=["one", "two", "three", "four", "sixes"],
)
def test_every_way_of_chunking_a_prompt_gives_the_token_by_token_attention(chunks, centered, attention_path):
    settings = KVCacheSettings(
        sink_tokens=4, recent_window=8, block_size=8, center_keys=centered, center_values=centered
    )
    one_at_a_time = attention_by_chunks(settings, [1] * TOKENS)
    got = attention_by_chunks(settings, chunks)
    assert mx.allclose(got, one_at_a_time, atol=2e-4).item(), mx.abs(got - one_at_a_time).max().item()


def test_without_chunk_invariance_a_chunk_sees_what_it_compressed_as_stored(monkeypatch):
    """The GPU setting: no exact copies are kept, and a one-chunk prompt differs from token by token."""
    settings = KVCacheSettings(sink_tokens=4, recent_window=8, block_size=8)
    one_at_a_time = attention_by_chunks(settings, [1] * TOKENS)
    monkeypatch.setattr(cache_module, "CHUNK_INVARIANT_PREFILL", False)
    assert not mx.allclose(attention_by_chunks(settings, [TOKENS]), one_at_a_time, atol=2e-4).item()
