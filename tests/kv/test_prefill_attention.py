"""Prefill over a long compressed run without a decompressed copy of the cache computes the
twin's numbers: the block-by-block online softmax (long runs on the twin) and query chunks
composed from key_scores and weighted_values (a GPU-style backend: every prefill there)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from services.core.kv import (
    KVCacheSettings,
    TurboQuantKVCache,
    attention,
    metal_attention,
    prefill_attention,
    turboquant_attention,
)
from services.core.kv.codec import TurboQuantCodec
from services.core.kv.prefill_attention import blockwise_attention, chunked_attention
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
@pytest.mark.parametrize("block", [4096, 16, 7])
@pytest.mark.parametrize("padding_rows", [0, 3])
def test_blockwise_prefill_equals_softmax_over_the_estimates(qjl, block, padding_rows):
    """block 7 splits the compressed run unevenly; padding rows (a batch's, past the cache's
    end) see everything and are dropped by the caller."""
    cache = prefilled(qjl, new_tokens=21)
    assert cache.compressed_length > 2 * 16
    queries = mx.random.normal((1, 6, 21 + padding_rows, 48))
    got = blockwise_attention(queries, cache, 0.2, start=cache.offset - 21, block=block)
    assert got.shape == queries.shape and not mx.isnan(got).any().item()
    assert mx.allclose(got[:, :, :21], reference_attention(queries[:, :, :21], cache, 0.2), atol=1e-4).item()


@pytest.mark.parametrize("qjl", [True, False])
@pytest.mark.parametrize("budget", [64 << 20, 6 * 4 * 110 * 4])
def test_query_chunks_composed_from_kernels_equal_softmax_over_the_estimates(qjl, budget, monkeypatch):
    """budget 6*4*110*4 bytes: 4 queries' scores at a time, so 21 queries run as 6 chunks, the
    last one padded."""
    monkeypatch.setattr(prefill_attention, "SCORES_BUDGET_BYTES", budget)
    cache = prefilled(qjl, new_tokens=21)
    queries = mx.random.normal((1, 6, 21, 48))
    got = chunked_attention(TwinBackend(), queries, cache, 0.2, start=cache.offset - 21)
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


def decoded_key_lengths(monkeypatch) -> list[int]:
    """Tokens per decoded key copy (TurboQuantCodec.estimated_keys), call by call."""
    lengths: list[int] = []
    original = TurboQuantCodec.estimated_keys

    def recorded(self, tokens, *args, **kwargs):
        lengths.append(tokens.length)
        return original(self, tokens, *args, **kwargs)

    monkeypatch.setattr(TurboQuantCodec, "estimated_keys", recorded)
    return lengths


def test_a_run_longer_than_a_block_is_read_block_by_block_on_the_twin(monkeypatch):
    monkeypatch.setattr(metal_attention, "kernel_backend", lambda: None)  # the twin
    monkeypatch.setattr(prefill_attention, "BLOCK_TOKENS", 16)
    blockwise = counting(monkeypatch, attention, "blockwise_attention")
    lengths = decoded_key_lengths(monkeypatch)
    cache = prefilled(qjl=True, new_tokens=12)
    queries = mx.random.normal((1, 6, 12, 48))
    got = turboquant_attention(queries, cache, scale=0.2)
    assert blockwise and len(lengths) >= 5 and max(lengths) <= 16
    assert mx.allclose(got, reference_attention(queries, cache, 0.2), atol=1e-4).item()


def test_a_run_within_a_block_keeps_the_fused_path_on_the_twin(monkeypatch):
    monkeypatch.setattr(metal_attention, "kernel_backend", lambda: None)
    lengths = decoded_key_lengths(monkeypatch)
    cache = prefilled(qjl=True, new_tokens=12)
    queries = mx.random.normal((1, 6, 12, 48))
    got = turboquant_attention(queries, cache, scale=0.2)
    assert lengths == [cache.compressed_length]  # ~80 compressed tokens: far below BLOCK_TOKENS
    assert mx.allclose(got, reference_attention(queries, cache, 0.2), atol=1e-4).item()


def test_a_gpu_backend_prefills_from_the_codes(monkeypatch):
    """A backend with key_scores (Metal, CUDA) serves every prefill: the compressed run is
    never decoded into keys, and padding rows past the cache's end (a batch's) are harmless."""
    backend = TwinBackend()
    monkeypatch.setattr(metal_attention, "kernel_backend", lambda: backend)
    scored = counting(monkeypatch, TwinBackend, "key_scores")
    lengths = decoded_key_lengths(monkeypatch)
    cache = prefilled(qjl=True, new_tokens=14)
    queries = mx.random.normal((1, 6, 16, 48))
    got = turboquant_attention(queries, cache, scale=0.2, query_start=cache.offset - 14)
    assert scored and not lengths
    assert mx.allclose(got[:, :, :14], reference_attention(queries[:, :, :14], cache, 0.2), atol=1e-4).item()
    assert not mx.isnan(got).any().item()
