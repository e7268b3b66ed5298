"""Prefill over a long compressed run without a decompressed copy of the cache: query chunks
composed from key_scores and weighted_values compute the twin's numbers, on the block-by-block
twin (long runs on any device) and on a GPU-style backend (every prefill there)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from services.core.kv import (
    KVCacheSettings,
    TurboQuantKVCache,
    metal_attention,
    prefill_attention,
    turboquant_attention,
)
from services.core.kv.codec import TurboQuantCodec
from services.core.kv.prefill_attention import BlockwiseTwin, chunked_attention
from tests.kv.test_fast_paths import reference_attention
from tests.kv.test_metal_kernels import TwinBackend


def prefilled(qjl: bool, new_tokens: int, seed: int = 0) -> TurboQuantKVCache:
    """A cache holding 90 tokens (sinks 4, window 8, blocks of 8: a compressed run of ~72),
    then `new_tokens` more appended as one prefill chunk."""
    settings = KVCacheSettings(key_qjl=qjl, sink_tokens=4, recent_window=8, block_size=8)
    mx.random.seed(seed)
    cache = TurboQuantKVCache(settings, layer=4)
    keys = mx.random.normal((1, 2, 90 + new_tokens, 48)) * 2
    values = mx.random.normal((1, 2, 90 + new_tokens, 48))
    cache.update_and_fetch(keys[:, :, :90], values[:, :, :90])
    cache.update_and_fetch(keys[:, :, 90:], values[:, :, 90:])
    return cache


@pytest.mark.parametrize("qjl", [True, False])
@pytest.mark.parametrize(("block", "budget"), [(4096, 64 << 20), (16, 64 << 20), (7, 6 * 4 * 110 * 4)])
def test_chunked_prefill_equals_softmax_over_the_estimates(qjl, block, budget, monkeypatch):
    """budget 6*4*110*4 bytes: 4 queries' scores at a time, so 21 queries run as 6 chunks, the
    last one padded; block 7 splits the compressed run unevenly."""
    monkeypatch.setattr(prefill_attention, "SCORES_BUDGET_BYTES", budget)
    cache = prefilled(qjl, new_tokens=21)
    assert cache.compressed_length > 2 * 16
    queries = mx.random.normal((1, 6, 21, 48))
    got = chunked_attention(BlockwiseTwin(block), queries, cache, 0.2, start=cache.offset - 21)
    assert got.shape == queries.shape
    assert mx.allclose(got, reference_attention(queries, cache, 0.2), atol=1e-4).item()


def counting(monkeypatch, owner, name: str) -> list:
    calls: list = []
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def test_a_run_longer_than_a_block_is_read_block_by_block_on_the_twin(monkeypatch):
    monkeypatch.setattr(metal_attention, "kernel_backend", lambda: None)  # the twin
    monkeypatch.setattr(prefill_attention, "BLOCK_TOKENS", 16)
    blockwise = counting(monkeypatch, BlockwiseTwin, "key_scores")
    whole = counting(monkeypatch, TurboQuantCodec, "estimated_keys")  # the fused path's decoded copy
    cache = prefilled(qjl=True, new_tokens=12)
    queries = mx.random.normal((1, 6, 12, 48))
    got = turboquant_attention(queries, cache, scale=0.2)
    assert blockwise and not whole
    assert mx.allclose(got, reference_attention(queries, cache, 0.2), atol=1e-4).item()


def test_a_run_within_a_block_keeps_the_fused_path_on_the_twin(monkeypatch):
    monkeypatch.setattr(metal_attention, "kernel_backend", lambda: None)
    whole = counting(monkeypatch, TurboQuantCodec, "estimated_keys")
    cache = prefilled(qjl=True, new_tokens=12)
    queries = mx.random.normal((1, 6, 12, 48))
    got = turboquant_attention(queries, cache, scale=0.2)
    assert whole  # ~80 compressed tokens: far below BLOCK_TOKENS
    assert mx.allclose(got, reference_attention(queries, cache, 0.2), atol=1e-4).item()


def test_a_gpu_backend_prefills_from_the_codes(monkeypatch):
    """A backend with key_scores (Metal, CUDA) serves every prefill: the compressed run is
    never decoded into keys, and padding rows past the cache's end (a batch's) are harmless."""
    backend = TwinBackend()
    monkeypatch.setattr(metal_attention, "kernel_backend", lambda: backend)
    scored = counting(monkeypatch, TwinBackend, "key_scores")
    whole = counting(monkeypatch, TurboQuantCodec, "estimated_keys")
    cache = prefilled(qjl=True, new_tokens=14)
    queries = mx.random.normal((1, 6, 16, 48))
    got = turboquant_attention(queries, cache, scale=0.2, query_start=cache.offset - 14)
    assert scored and not whole
    assert mx.allclose(got[:, :, :14], reference_attention(queries[:, :, :14], cache, 0.2), atol=1e-4).item()
    assert not mx.isnan(got).any().item()
