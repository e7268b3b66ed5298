"""Mean-centred keys: the cache stores k - mu for every key of a sequence, and attention
over it is still attention over the original keys (the shift q.mu is one constant per
query, which the softmax ignores), with a smaller quantization error."""

from __future__ import annotations

import mlx.core as mx
import pytest

from services.core.kv import KVCacheSettings
from services.core.kv.attention import turboquant_attention
from services.core.kv.cache import TurboQuantKVCache

SMALL = dict(sink_tokens=4, recent_window=32, block_size=16)
CENTERED = dict(center_keys=True, **SMALL)


def keys_with_a_common_part(seed: int, tokens: int, heads: int = 2, dim: int = 64):
    """Keys like a real model's: a large shared direction per head plus per-token noise."""
    mx.random.seed(seed)
    common = 3.0 * mx.random.normal((1, heads, 1, dim))
    keys = common + mx.random.normal((1, heads, tokens, dim))
    return keys, mx.random.normal((1, heads, tokens, dim))


def exact_attention(queries, keys, values, scale):
    L = queries.shape[2]
    return mx.fast.scaled_dot_product_attention(
        queries, keys, values, scale=scale, mask="causal" if L > 1 else None
    )


def filled(settings: KVCacheSettings, keys, values, chunks=(40, 30, 1, 1, 1, 27)) -> TurboQuantKVCache:
    cache = TurboQuantKVCache(settings, layer=3)
    start = 0
    for n in chunks:
        cache.update_and_fetch(keys[:, :, start : start + n], values[:, :, start : start + n])
        start += n
    assert start == keys.shape[2]
    return cache


def test_stored_keys_are_the_given_keys_minus_one_mean_per_head():
    keys, values = keys_with_a_common_part(0, 100)
    cache = filled(KVCacheSettings(**CENTERED), keys, values)
    mu = cache.key_offset
    assert mu.shape == (1, 2, 1, 64)
    assert cache.compressed_length == 64  # 100 - 4 sinks - 32 window, in whole blocks
    # mu is the mean of the first compressed block: the 40-token chunk fills the window, the
    # next 30 age two blocks (tokens 4..35) at once, and mu is the first one's (4..19), as it
    # would be had the tokens come one at a time
    assert mx.allclose(mu, mx.mean(keys[:, :, 4:20], axis=2, keepdims=True), atol=1e-5)
    # exact runs: stored + mu gives back the keys, including those stored before mu existed
    assert mx.allclose(cache.sink_keys + mu, keys[:, :, :4], atol=1e-5)
    assert mx.allclose(cache.recent_keys + mu, keys[:, :, 68:], atol=1e-5)
    # the packed run decodes to the centred keys (MSE stage: error well under the offset)
    decoded = cache.key_codec.decode(cache.compressed_keys) + mu
    error = mx.mean(mx.sum((decoded - keys[:, :, 4:68]) ** 2, axis=-1)).item()
    offset = mx.mean(mx.sum(mu**2, axis=-1)).item()
    assert error < 0.2 * offset
    # update_and_fetch still hands the model its keys unchanged
    k, v = mx.ones((1, 2, 1, 64)), mx.zeros((1, 2, 1, 64))
    got_k, _ = cache.update_and_fetch(k, v)
    assert mx.array_equal(got_k, k)


def test_no_compression_means_no_centering_and_exact_attention():
    keys, values = keys_with_a_common_part(1, 30)
    cache = filled(KVCacheSettings(**CENTERED), keys, values, chunks=(30,))
    assert cache.key_offset is None and cache.compressed_length == 0
    queries = mx.random.normal((1, 4, 30, 64))
    got = turboquant_attention(queries, cache, 0.125)
    assert mx.allclose(got, exact_attention(queries, keys, values, 0.125), atol=1e-5)


@pytest.mark.parametrize("n_queries", [1, 3, 24])
def test_centering_cuts_the_attention_error_on_keys_with_a_common_part(n_queries, attention_path):
    keys, values = keys_with_a_common_part(2, 160)
    queries = 0.5 * mx.random.normal((1, 4, n_queries, 64))
    exact = exact_attention(queries, keys, values, 0.125)[:, :, -n_queries:]
    errors = {}
    for center in (False, True):
        settings = KVCacheSettings(key_bits=2, value_bits=4, center_keys=center, **SMALL)
        cache = filled(settings, keys, values, chunks=(160 - n_queries, n_queries))
        got = turboquant_attention(queries, cache, 0.125)
        errors[center] = mx.sqrt(mx.mean((got - exact) ** 2)).item()
    assert errors[True] < 0.6 * errors[False], errors


def test_trim_into_the_compressed_run_keeps_the_shift_consistent(attention_path):
    keys, values = keys_with_a_common_part(3, 140)
    settings = KVCacheSettings(key_bits=4, value_bits=4, key_qjl=False, **CENTERED)
    cache = filled(settings, keys, values, chunks=(120, 20))
    mu = cache.key_offset
    cache.trim(70)  # through the window into the compressed run: 4 sinks + 66 compressed left
    assert cache.offset == 70 and cache.compressed_length == 66 and cache.key_offset is mu
    cache.update_and_fetch(keys[:, :, 70:100], values[:, :, 70:100])  # refeed 30 tokens
    assert cache.offset == 100
    assert mx.allclose(cache.recent_keys + mu, keys[:, :, 70:100], atol=1e-5)
    queries = mx.random.normal((1, 4, 1, 64))
    got = turboquant_attention(queries, cache, 0.125)
    want = exact_attention(queries, keys[:, :, :100], values[:, :, :100], 0.125)
    assert mx.sqrt(mx.mean((got - want) ** 2)).item() < 0.05


def test_rows_of_a_batch_keep_their_own_mean():
    from services.core.kv.batch_cache import BatchTurboQuantKVCache
    from services.core.kv.sdpa_hook import turboquant_cache_attention

    first, first_v = keys_with_a_common_part(4, 100)
    second, second_v = keys_with_a_common_part(5, 100)
    settings = KVCacheSettings(**CENTERED)
    batch = BatchTurboQuantKVCache.merge(
        [filled(settings, first, first_v), filled(settings, second, second_v)]
    )
    mus = [row.key_offset for row in batch.rows]
    assert not mx.allclose(mus[0], mus[1])
    queries = mx.random.normal((2, 4, 1, 64))
    got = turboquant_cache_attention(batch, queries, 0.125)
    for i, (k, v) in enumerate(((first, first_v), (second, second_v))):
        want = exact_attention(queries[i : i + 1], k, v, 0.125)
        assert mx.sqrt(mx.mean((got[i : i + 1] - want) ** 2)).item() < 0.1


@pytest.mark.parametrize("n_queries", [1, 24])
def test_value_centering_adds_the_offset_back_once(n_queries, attention_path):
    keys, _ = keys_with_a_common_part(6, 160)
    values, _ = keys_with_a_common_part(7, 160)  # values with a large common part too
    queries = 0.5 * mx.random.normal((1, 4, n_queries, 64))
    exact = exact_attention(queries, keys, values, 0.125)[:, :, -n_queries:]
    errors = {}
    for center in (False, True):
        settings = KVCacheSettings(value_bits=2, center_values=center, **SMALL)
        cache = filled(settings, keys, values, chunks=(160 - n_queries, n_queries))
        if center:
            window = cache.recent_values
            assert mx.allclose(window + cache.value_offset, values[:, :, -window.shape[2] :], atol=1e-5)
        got = turboquant_attention(queries, cache, 0.125)
        errors[center] = mx.sqrt(mx.mean((got - exact) ** 2)).item()
    assert errors[True] < 0.6 * errors[False], errors


def test_the_default_is_the_papers_algorithm_without_offsets():
    keys, values = keys_with_a_common_part(8, 100)
    cache = filled(KVCacheSettings(**SMALL), keys, values)
    assert cache.compressed_length == 64
    assert cache.key_offset is None and cache.value_offset is None
    assert mx.array_equal(cache.sink_keys, keys[:, :, :4])
