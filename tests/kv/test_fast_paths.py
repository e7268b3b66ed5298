"""The fast paths compute the twin's numbers: table-lookup decoding, preallocated token
buffers, the compiled decode step (with slack slots masked), QJL folded into keys."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from services.core.kv import KVCacheSettings, TurboQuantKVCache, turboquant_attention
from services.core.kv import cache as kv_cache
from services.core.kv.codec import TurboQuantCodec
from services.core.kv.packing import lookup_decode, lookup_table, pack_indices, unpack_indices
from services.core.kv.token_buffer import TokenBuffer


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_table_lookup_decodes_every_index_to_its_level(bits):
    levels = np.random.default_rng(bits).standard_normal(2**bits).astype(np.float32)
    indices = mx.array(np.random.default_rng(7).integers(0, 2**bits, size=(2, 3, 9, 64)).astype(np.uint8))
    codes = pack_indices(indices, bits)
    table = mx.array(lookup_table(bits, levels))
    assert mx.array_equal(lookup_decode(codes, bits, table), mx.array(levels)[unpack_indices(codes, bits)])


def test_token_buffer_appends_in_place_grows_in_steps_and_never_changes_a_shared_buffer():
    tokens = mx.arange(2 * 10 * 3, dtype=mx.float32).reshape(1, 2, 10, 3)
    first = TokenBuffer.of([tokens[:, :, :4]], step=8)
    assert (first.length, first.capacity) == (4, 8)
    second = first.appended([tokens[:, :, 4:7]])
    assert (second.length, second.capacity) == (7, 8)
    third = second.appended([tokens[:, :, 7:10]])  # past capacity: grows to the next step
    assert (third.length, third.capacity) == (10, 16)
    assert mx.array_equal(third.views()[0], tokens)
    assert mx.array_equal(first.views()[0], tokens[:, :, :4])  # earlier buffers are untouched
    assert mx.array_equal(second.views()[0], tokens[:, :, :7])
    dropped = third.without_first(6)
    assert (dropped.length, dropped.capacity) == (4, 16)
    assert mx.array_equal(dropped.views()[0], tokens[:, :, 6:])
    assert mx.array_equal(dropped.arrays[0][:, :, 4:], mx.zeros((1, 2, 12, 3)))  # slack is zeros
    cut = third.truncated(5)
    assert (cut.length, cut.capacity) == (5, 5) and mx.array_equal(cut.views()[0], tokens[:, :, :5])
    assert TokenBuffer.of([tokens], step=8, limit=12).capacity == 12


def reference_attention(queries, cache, scale):
    """softmax over the twin's estimated scores (key_scores), causal, values decoded."""
    codec = cache.key_codec
    q = queries * scale
    n_q = queries.shape[2]
    parts, values = [], []
    if cache.sink_keys is not None:
        parts.append(q @ mx.repeat(cache.sink_keys, 3, axis=1).swapaxes(-1, -2))
        values.append(cache.sink_values)
    if cache.compressed_keys is not None:
        rotated = codec.rotate_queries(q)
        tokens = cache.compressed_keys
        parts.append(codec.key_scores(rotated, tokens._map(lambda a: mx.repeat(a, 3, axis=1))))
        values.append(cache.value_codec.decode(cache.compressed_values))
    if cache.recent_keys is not None and cache.recent_keys.shape[2]:
        parts.append(q @ mx.repeat(cache.recent_keys, 3, axis=1).swapaxes(-1, -2))
        values.append(cache.recent_values)
    scores = mx.concatenate(parts, axis=-1)
    positions = cache.offset - n_q + mx.arange(n_q)
    scores = mx.where(positions[:, None] >= mx.arange(cache.offset)[None], scores, -mx.inf)
    return mx.softmax(scores, axis=-1) @ mx.repeat(mx.concatenate(values, axis=2), 3, axis=1)


@pytest.mark.parametrize(
    ("sinks", "window", "n_queries"),
    [(4, 8, 1), (4, 8, 8), (0, 8, 3), (4, 0, 1), (4, 0, 6), (2, 3, 5)],
)
def test_decode_step_equals_softmax_over_the_estimates(sinks, window, n_queries, attention_path):
    """Window 0: the newest queries are already compressed, so the causal mask must reach
    into the compressed run; block 8 with step-256 buffers leaves slack slots to mask."""
    settings = KVCacheSettings(key_qjl=True, sink_tokens=sinks, recent_window=window, block_size=8)
    mx.random.seed(sinks + window + n_queries)
    cache = TurboQuantKVCache(settings, layer=1)
    keys = mx.random.normal((2, 2, 70 + n_queries, 40)) * 2
    values = mx.random.normal((2, 2, 70 + n_queries, 40))
    cache.update_and_fetch(keys[:, :, :70], values[:, :, :70])
    cache.update_and_fetch(keys[:, :, 70:], values[:, :, 70:])
    cache.just_aged = None  # queries over the stored runs (the last update's own: test_chunk_invariance)
    assert cache.compressed_key_buffer.capacity > cache.compressed_length  # slack exists
    queries = mx.random.normal((2, 6, n_queries, 40))
    got = turboquant_attention(queries, cache, scale=0.3)
    assert mx.allclose(got, reference_attention(queries, cache, 0.3), atol=1e-4).item()


def test_decode_steps_across_blocks_and_a_trim_stay_exact(attention_path):
    settings = KVCacheSettings(key_qjl=True, sink_tokens=4, recent_window=8, block_size=8)
    mx.random.seed(3)
    cache = TurboQuantKVCache(settings, layer=2)
    keys, values = mx.random.normal((1, 2, 60, 32)), mx.random.normal((1, 2, 60, 32))
    cache.update_and_fetch(keys[:, :, :30], values[:, :, :30])
    for t in range(30, 60):  # decode steps: blocks age out of the window on the way
        cache.update_and_fetch(keys[:, :, t : t + 1], values[:, :, t : t + 1])
        queries = mx.random.normal((1, 6, 1, 32))
        assert mx.allclose(
            turboquant_attention(queries, cache, 0.2), reference_attention(queries, cache, 0.2), atol=1e-4
        ).item()
    cache.trim(21)  # into the compressed run
    queries = mx.random.normal((1, 6, 1, 32))
    assert mx.allclose(
        turboquant_attention(queries, cache, 0.2), reference_attention(queries, cache, 0.2), atol=1e-4
    ).item()


def test_decode_steps_encode_only_the_block_that_ages(monkeypatch):
    """Compression appends: a decode step that ages a block encodes that block alone,
    never the run again."""
    settings = KVCacheSettings(sink_tokens=4, recent_window=16, block_size=8)
    cache = TurboQuantKVCache(settings, layer=0)
    keys = mx.random.normal((1, 2, 100, 32))
    cache.update_and_fetch(keys[:, :, :60], keys[:, :, :60])
    encoded = []
    original = kv_cache._encode  # the codec's encode, or a GPU backend's pack kernel
    monkeypatch.setattr(
        kv_cache, "_encode", lambda codec, x: encoded.append(x.shape[2]) or original(codec, x)
    )
    for t in range(60, 100):
        cache.update_and_fetch(keys[:, :, t : t + 1], keys[:, :, t : t + 1])
    assert encoded and set(encoded) == {8}  # keys and values, one block each time
    assert cache.compressed_length == 100 - 4 - cache.recent_keys.shape[2]


def test_folded_qjl_keys_give_the_same_scores():
    codec = TurboQuantCodec(48, 3, True, seed=5)
    tokens = codec.encode(mx.random.normal((1, 2, 33, 48)))
    rotated = codec.rotate_queries(mx.random.normal((1, 2, 4, 48)))
    folded = rotated @ codec.estimated_keys(tokens).swapaxes(-1, -2)
    assert mx.allclose(folded, codec.key_scores(rotated, tokens), atol=1e-4).item()
