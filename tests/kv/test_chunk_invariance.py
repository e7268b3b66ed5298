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


def deferred_reference(settings: KVCacheSettings, chunks: list[int], seed: int = 3) -> mx.array:
    """What a chunk's queries must see where aging waits for the chunk's attention (GPUs): the
    tokens compressed before the chunk from their codes, every later one exact, causally. Built
    from a token-by-token cache (same codes: a token's code does not depend on chunking) and
    plain attention in the original domain."""
    mx.random.seed(seed)
    keys = mx.random.normal((1, 2, TOKENS, 48)) * 3 + 1
    values = mx.random.normal((1, 2, TOKENS, 48))
    queries = mx.random.normal((1, 6, TOKENS, 48))
    cache, sinks = TurboQuantKVCache(settings, layer=2), settings.sink_tokens
    for i in range(TOKENS):
        cache.update_and_fetch(keys[:, :, i : i + 1], values[:, :, i : i + 1])
    key_offset = 0 if cache.key_offset is None else cache.key_offset
    value_offset = 0 if cache.value_offset is None else cache.value_offset
    packed_keys = cache.key_codec.rotation.inverse(cache.key_codec.estimated_keys(cache.compressed_keys))
    packed_values = cache.value_codec.decode(cache.compressed_values)
    outputs, start = [], 0
    for n in chunks:
        # the tokens before the chunk beyond sinks and window, in whole blocks (a one-token update,
        # a decode step, counts itself: it ages before its attention, as it always did)
        beyond = start + (n == 1) - sinks - settings.recent_window
        compressed = max(0, beyond) // settings.block_size * settings.block_size
        end = start + n
        seen_keys = [keys[:, :, :sinks], packed_keys[:, :, :compressed] + key_offset]
        seen_values = [values[:, :, :sinks], packed_values[:, :, :compressed] + value_offset]
        seen_keys.append(keys[:, :, sinks + compressed : end])
        seen_values.append(values[:, :, sinks + compressed : end])
        outputs.append(
            mx.fast.scaled_dot_product_attention(
                queries[:, :, start:end],
                mx.repeat(mx.concatenate(seen_keys, axis=2), 3, axis=1),
                mx.repeat(mx.concatenate(seen_values, axis=2), 3, axis=1),
                scale=0.2,
                mask="causal" if n > 1 else None,
            )
        )
        start = end
    return mx.concatenate(outputs, axis=2)


@pytest.mark.parametrize("centered", [False, True], ids=["plain", "centred"])
@pytest.mark.parametrize(
    "chunks", [[45], [13, 32], [20, 7, 1, 17], [6] * 7 + [3]], ids=["one", "two", "four", "sixes"]
)
def test_where_aging_waits_for_attention_a_chunk_sees_everything_after_the_old_window_exact(
    chunks, centered, attention_path, monkeypatch
):
    """The GPU setting (one fused call per chunk): a chunk's tokens are compressed only after its
    attention ran, so each query sees at least its own window exact, and the cache ends as it
    would token by token."""
    settings = KVCacheSettings(
        sink_tokens=4, recent_window=8, block_size=8, center_keys=centered, center_values=centered
    )
    want = deferred_reference(settings, chunks)
    monkeypatch.setattr(cache_module, "CHUNK_INVARIANT_PREFILL", False)
    got = attention_by_chunks(settings, chunks)  # asserts the final layout too
    cache = TurboQuantKVCache(settings, layer=2)
    cache.update_and_fetch(mx.ones((1, 2, TOKENS, 48)), mx.ones((1, 2, TOKENS, 48)))
    turboquant_attention(mx.ones((1, 6, TOKENS, 48)), cache, scale=0.2)
    assert cache.recent_buffer.capacity <= 8 + 8  # the chunk's spare room given back once aged
    assert mx.allclose(got, want, atol=2e-4).item(), mx.abs(got - want).max().item()
