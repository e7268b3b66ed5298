"""Prefill over a compressed run whose decoded copy would pass the budget computes the same
numbers block by block (an online softmax), in float32 and in a GPU's half type, and the
budget decides which path a prefill takes."""

from __future__ import annotations

import mlx.core as mx
import pytest

from services.core.kv import (
    KVCacheSettings,
    TurboQuantKVCache,
    attention,
    kernel_select,
    prefill_attention,
    turboquant_attention,
)
from services.core.kv.codec import TurboQuantCodec
from services.core.kv.prefill_attention import block_tokens, blockwise_attention, decoded_bytes_per_token
from tests.kv.test_fast_paths import reference_attention
from tests.kv.test_metal_kernels import TwinBackend


def prefilled(qjl: bool, new_tokens: int, seed: int = 0) -> TurboQuantKVCache:
    """A cache holding 90 tokens (sinks 4, window 8, blocks of 8: a compressed run of ~72),
    then `new_tokens` more appended as one prefill chunk. The queries here see the stored runs
    as they are (how the last update's own queries see the tokens it compressed is
    test_chunk_invariance's)."""
    settings = KVCacheSettings(key_qjl=qjl, sink_tokens=4, recent_window=8, block_size=8)
    mx.random.seed(seed)
    cache = TurboQuantKVCache(settings, layer=4)
    keys = mx.random.normal((1, 2, 90 + new_tokens, 48)) * 2
    values = mx.random.normal((1, 2, 90 + new_tokens, 48))
    cache.update_and_fetch(keys[:, :, :90], values[:, :, :90])
    cache.update_and_fetch(keys[:, :, 90:], values[:, :, 90:])
    cache.just_aged = None
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


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_blockwise_prefill_in_half_precision_stays_close(dtype):
    """A GPU runs the block matmuls in the model's half type; softmax statistics stay float32."""
    cache = prefilled(True, new_tokens=21)
    queries = mx.random.normal((1, 6, 21, 48))
    got = blockwise_attention(
        queries.astype(dtype), cache, 0.2, start=cache.offset - 21, block=16, dtype=dtype
    )
    assert got.dtype == dtype
    want = reference_attention(queries, cache, 0.2)
    assert mx.allclose(got.astype(mx.float32), want, atol=0.05).item()


def test_blocks_fit_the_budget_with_their_scores(monkeypatch):
    cache = prefilled(True, new_tokens=21)
    queries = mx.random.normal((1, 6, 21, 48))
    per_token = decoded_bytes_per_token(cache, mx.float32)  # 2 heads x (64 + 64) x 4
    assert per_token == 2 * 128 * 4
    monkeypatch.setattr(prefill_attention, "DECODED_BUDGET_BYTES", 10 * (per_token + 4 * 6 * 21))
    assert block_tokens(cache, queries, mx.float32) == 10


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


class RecordingBackend(TwinBackend):
    """GPU-style kernels that note the tokens of every run they decode."""

    def __init__(self):
        self.decoded: list[int] = []

    def decoded_run(self, key_codec, value_codec, keys, values, dtype):
        self.decoded.append(keys.length)
        return super().decoded_run(key_codec, value_codec, keys, values, dtype)


@pytest.mark.parametrize("backend", [None, RecordingBackend()], ids=["twin", "gpu-style kernels"])
def test_a_run_whose_decoded_copy_passes_the_budget_is_read_block_by_block(backend, monkeypatch):
    monkeypatch.setattr(kernel_select, "kernel_backend", lambda: backend)
    monkeypatch.setattr(prefill_attention, "DECODED_BUDGET_BYTES", 16 * (2 * 128 * 4 + 4 * 6 * 12))
    blockwise = counting(monkeypatch, attention, "blockwise_attention")
    lengths = decoded_key_lengths(monkeypatch)
    cache = prefilled(qjl=True, new_tokens=12)
    queries = mx.random.normal((1, 6, 12, 48))
    got = turboquant_attention(queries, cache, scale=0.2)
    assert blockwise and len(lengths) >= 5 and max(lengths) <= 16
    if backend is not None:  # every block decoded by the backend's kernel
        assert backend.decoded == lengths
    assert mx.allclose(got, reference_attention(queries, cache, 0.2), atol=1e-4).item()


@pytest.mark.parametrize("backend", [None, RecordingBackend()], ids=["twin", "gpu-style kernels"])
def test_a_run_within_the_budget_takes_one_fused_call(backend, monkeypatch):
    """Whatever kernels the device has: a prefill over a run whose decoded copy fits the budget
    decodes it once and runs one fused attention call (the fastest path on every device)."""
    monkeypatch.setattr(kernel_select, "kernel_backend", lambda: backend)
    lengths = decoded_key_lengths(monkeypatch)
    fused = counting(monkeypatch, mx.fast, "scaled_dot_product_attention")
    cache = prefilled(qjl=True, new_tokens=12)
    queries = mx.random.normal((1, 6, 12, 48))
    got = turboquant_attention(queries, cache, scale=0.2)
    assert lengths == [cache.compressed_length] and len(fused) == 1
    if backend is not None:
        assert backend.decoded == lengths
    assert mx.allclose(got, reference_attention(queries, cache, 0.2), atol=1e-4).item()
