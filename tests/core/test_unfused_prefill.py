"""Small prefill chunks run unfused on CUDA (services/core/kv/unfused_prefill.py): the same
attention as the fused kernel, for every mask mlx-lm passes, and only where it is meant to run."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from services.core.kv import unfused_prefill
from services.core.kv.sdpa_hook import make_hooked_sdpa
from services.core.kv.unfused_prefill import UNFUSED_SCORE_BYTES, unfused_attention, unfused_wanted


def qkv(rows=3, q_heads=8, kv_heads=2, length=5, keys=12, dims=16):
    mx.random.seed(0)
    return (
        mx.random.normal((rows, q_heads, length, dims)),
        mx.random.normal((rows, kv_heads, keys, dims)),
        mx.random.normal((rows, kv_heads, keys, dims)),
    )


def fused(q, k, v, mask):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)


@pytest.mark.parametrize("kv_heads", [1, 2, 8])
def test_causal_string_mask_matches_the_fused_kernel(kv_heads):
    q, k, v = qkv(kv_heads=kv_heads)
    out = unfused_attention(q, k, v, 0.25, "causal")
    assert mx.allclose(out, fused(q, k, v, "causal"), atol=1e-5).item()


def test_batch_mask_with_padding_matches_the_fused_kernel():
    # BatchKVCache's mask: rows left-padded by different amounts, queries after an offset of 7
    q, k, v = qkv(length=5, keys=12)
    mask = create_causal_mask(5, 7, left_padding=mx.array([0, 3, 6]))
    assert mask.dtype == mx.bool_ and mask.shape == (3, 1, 5, 12)
    out = unfused_attention(q, k, v, 0.25, mask)
    assert mx.allclose(out, fused(q, k, v, mask), atol=1e-5).item()


def test_additive_mask_and_no_mask_match_the_fused_kernel():
    q, k, v = qkv(kv_heads=4)
    additive = mx.where(create_causal_mask(5, 7), 0.0, -1e9)
    assert mx.allclose(unfused_attention(q, k, v, 0.25, additive), fused(q, k, v, additive), atol=1e-5).item()
    assert mx.allclose(unfused_attention(q, k, v, 0.25, None), fused(q, k, v, None), atol=1e-5).item()


def test_bfloat16_keeps_its_dtype():
    q, k, v = (a.astype(mx.bfloat16) for a in qkv())
    out = unfused_attention(q, k, v, 0.25, "causal")
    assert out.dtype == mx.bfloat16
    reference = fused(*(a.astype(mx.float32) for a in (q, k, v)), "causal")
    assert mx.allclose(out.astype(mx.float32), reference, atol=3e-2).item()


def test_only_small_prefill_chunks_on_cuda(monkeypatch):
    q, k, _ = qkv()
    monkeypatch.setattr(unfused_prefill, "_on_cuda", lambda: False)
    assert not unfused_wanted(q, k)  # CPUs and Apple GPUs: always the fused kernel
    monkeypatch.setattr(unfused_prefill, "_on_cuda", lambda: True)
    assert unfused_wanted(q, k)
    assert not unfused_wanted(q[:, :, :1], k)  # decode: one query, the fused vector kernel
    keys = UNFUSED_SCORE_BYTES // (3 * 8 * 5 * 4) + 1  # scores just over the budget
    assert not unfused_wanted(q, mx.zeros((3, 2, keys, 16)))


def test_the_hook_routes_small_prefill_on_cuda_only(monkeypatch):
    q, k, v = qkv()
    calls = []

    def original(queries, keys, values, cache, scale, mask, sinks=None):
        calls.append(cache)
        return fused(queries, keys, values, mask)

    hooked = make_hooked_sdpa(original)
    monkeypatch.setattr(unfused_prefill, "_on_cuda", lambda: True)
    out = hooked(q, k, v, cache=KVCache(), scale=0.25, mask="causal")
    assert not calls and mx.allclose(out, fused(q, k, v, "causal"), atol=1e-5).item()
    hooked(q, k, v, cache=QuantizedKVCache(), scale=0.25, mask="causal")  # quantized: mlx-lm's own
    hooked(q[:, :, :1], k, v, cache=KVCache(), scale=0.25, mask=None)  # decode
    monkeypatch.setattr(unfused_prefill, "_on_cuda", lambda: False)
    hooked(q, k, v, cache=KVCache(), scale=0.25, mask="causal")
    assert len(calls) == 3


def test_a_plain_cache_installs_the_hook_and_unfused_prefill_keeps_greedy_tokens(tiny_models, monkeypatch):
    """make_kv_cache("fp16") hooks the model (the CUDA path needs it with plain caches too), and
    a model prefilling unfused in chunks of 5 generates what mlx-lm's fused kernel does."""
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    from services.core.kv import factory
    from services.core.kv.factory import make_kv_cache

    model, _ = load(str(tiny_models.checkpoint("qwen3_moe", None)))
    prompt = list(range(100, 123))

    def greedy():
        steps = generate_step(
            mx.array(prompt),
            model,
            prompt_cache=make_kv_cache(model, "fp16"),
            max_tokens=8,
            prefill_step_size=5,
        )
        return [token for token, _ in steps]

    monkeypatch.setattr(factory, "cuda_available", lambda: True)  # as on an NVIDIA GPU
    fused_tokens = greedy()  # installs the hook; off the GPU it passes through
    used = []
    monkeypatch.setattr(unfused_prefill, "_on_cuda", lambda: True)
    monkeypatch.setattr(
        unfused_prefill, "unfused_attention", lambda *a: used.append(1) or unfused_attention(*a)
    )
    import services.core.kv.sdpa_hook as sdpa_hook

    monkeypatch.setattr(sdpa_hook, "unfused_attention", unfused_prefill.unfused_attention)
    assert greedy() == fused_tokens
    assert used  # the prefill chunks took the unfused path
