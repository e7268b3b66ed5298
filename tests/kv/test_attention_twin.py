"""The rotated-domain attention (pure-MLX twin) against plain attention over the
decoded cache, and the compressed size."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import pytest

from services.core.kv import (
    PAPER_SETTINGS,
    KVCacheSettings,
    TurboQuantKVCache,
    kv_cache_bytes,
    turboquant_attention,
)


def filled_cache(settings: KVCacheSettings, lengths: list[int], heads=2, dim=48, seed=0):
    mx.random.seed(seed)
    cache = TurboQuantKVCache(settings, layer=3)
    total = sum(lengths)
    keys = mx.random.normal((1, heads, total, dim)) * 3
    values = mx.random.normal((1, heads, total, dim))
    start = 0
    for n in lengths:
        cache.update_and_fetch(keys[:, :, start : start + n], values[:, :, start : start + n])
        start += n
    return cache


def decoded(cache: TurboQuantKVCache):
    parts_k = [cache.sink_keys, cache.key_codec.decode(cache.compressed_keys), cache.recent_keys]
    parts_v = [cache.sink_values, cache.value_codec.decode(cache.compressed_values), cache.recent_values]
    return mx.concatenate(parts_k, axis=2), mx.concatenate(parts_v, axis=2)


@pytest.mark.parametrize("queries_len", [1, 7, 12])  # decode form (<= 8 queries) and fused-SDPA form
def test_twin_equals_attention_over_the_decoded_cache(queries_len, attention_path):
    # dim 48 is padded to 64 for the transform; 6 query heads over 2 KV heads (GQA)
    settings = KVCacheSettings(key_qjl=False, sink_tokens=4, recent_window=8, block_size=8)
    cache = filled_cache(settings, [30, 13, queries_len])
    assert cache.compressed_length > 0 and cache.sink_keys.shape[2] == 4
    cache.just_aged = None  # queries over the stored runs alone (the last update's: test_chunk_invariance)
    keys, values = decoded(cache)
    queries = mx.random.normal((1, 6, queries_len, 48))
    positions = cache.offset - queries_len + mx.arange(queries_len)
    mask = positions[:, None] >= mx.arange(cache.offset)[None]
    expected = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.15, mask=mask)
    got = turboquant_attention(queries, cache, scale=0.15)
    assert mx.allclose(got, expected, atol=1e-4).item()


@pytest.mark.parametrize("queries_len", [1, 5, 12])
def test_twin_with_qjl_equals_softmax_over_the_estimated_scores(queries_len, attention_path):
    settings = KVCacheSettings(key_qjl=True, sink_tokens=4, recent_window=8, block_size=8)
    cache = filled_cache(settings, [40, queries_len])
    cache.just_aged = None  # queries over the stored runs (the last update's own: test_chunk_invariance)
    codec = cache.key_codec
    queries = mx.random.normal((1, 2, queries_len, 48))
    scores = mx.concatenate(
        [
            queries @ cache.sink_keys.swapaxes(-1, -2),
            codec.key_scores(codec.rotate_queries(queries), cache.compressed_keys),
            queries @ cache.recent_keys.swapaxes(-1, -2),
        ],
        axis=-1,
    )
    positions = cache.offset - queries_len + mx.arange(queries_len)
    scores = mx.where(positions[:, None] >= mx.arange(cache.offset)[None], scores * 0.2, -mx.inf)
    _, values = decoded(cache)
    expected = mx.softmax(scores, axis=-1) @ values
    assert mx.allclose(turboquant_attention(queries, cache, scale=0.2), expected, atol=1e-4).item()


def test_qjl_scores_add_the_residual_estimate():
    settings = KVCacheSettings(key_qjl=True, sink_tokens=0, recent_window=0, block_size=4)
    cache = filled_cache(settings, [16])
    codec, tokens = cache.key_codec, cache.compressed_keys
    rotated = codec.rotate_queries(mx.random.normal((1, 2, 3, 48)))
    mse_part = rotated @ (codec.centroid_values(tokens) * tokens.norm[..., None]).swapaxes(-1, -2)
    raw = tokens.qjl_signs[..., None] >> mx.arange(8, dtype=mx.uint8)
    signs = (raw & 1).reshape(*tokens.qjl_signs.shape[:-1], -1).astype(mx.float32) * 2 - 1
    weight = tokens.residual_norm.astype(mx.float32) * codec.qjl_scale * tokens.norm.astype(mx.float32)
    qjl_part = ((rotated @ codec.qjl_matrix_t) @ signs.swapaxes(-1, -2)) * weight[..., None, :]
    full = codec.key_scores(rotated, tokens)
    assert mx.allclose(full, mse_part + qjl_part, atol=1e-4).item()
    assert not mx.allclose(full, mse_part, atol=1e-3).item()  # the QJL term is really there


@pytest.mark.parametrize(
    ("bits", "key_bytes"),
    # the default K4: 4-bit codes + one fp16 norm; the paper's K3+QJL: 3-bit codes + 1-bit QJL
    # + two fp16 norms. V3 in both: 3-bit codes + one fp16 norm (48 + 2 bytes)
    [(KVCacheSettings(), 64 + 2), (PAPER_SETTINGS, 48 + 16 + 4)],
    ids=lambda x: x.describe() if isinstance(x, KVCacheSettings) else x,
)
def test_compressed_bytes_per_token_at_head_dim_128_are_3_5x_below_fp16(bits, key_bytes):
    settings = dataclasses.replace(bits, sink_tokens=0, recent_window=0, block_size=64)
    cache = filled_cache(settings, [512], heads=4, dim=128)
    assert cache.compressed_length == 512 and cache.recent_keys.shape[2] == 0
    fp16_bytes = 512 * 4 * 128 * 2 * 2  # keys + values, 2 bytes each
    assert kv_cache_bytes([cache]) == cache.nbytes
    assert fp16_bytes / cache.nbytes >= 3.5
    assert cache.nbytes == 512 * 4 * (key_bytes + (48 + 2))


@pytest.mark.parametrize(
    "lengths", [[3], [20], [20, 1], [9, 5]], ids=["sinks-only", "prefill", "decode", "chunks"]
)
def test_within_sinks_and_window_it_is_the_fp16_caches_own_attention(lengths):
    """Nothing compressed yet (most chats): the same fused call over the same keys as mlx-lm's
    KVCache, so the numbers are identical, not merely close."""
    from mlx_lm.models.cache import KVCache

    settings = KVCacheSettings(sink_tokens=4, recent_window=32, block_size=8)
    cache, reference = TurboQuantKVCache(settings, layer=0), KVCache()
    mx.random.seed(7)
    for n in lengths:
        keys, values = mx.random.normal((1, 2, n, 48)) * 3, mx.random.normal((1, 2, n, 48))
        cache.update_and_fetch(keys, values)
        all_keys, all_values = reference.update_and_fetch(keys, values)
        queries = mx.random.normal((1, 6, n, 48))
        want = mx.fast.scaled_dot_product_attention(
            queries, all_keys, all_values, scale=0.15, mask="causal" if n > 1 else None
        )
        assert cache.compressed_length == 0
        assert mx.array_equal(turboquant_attention(queries, cache, scale=0.15), want).item()
