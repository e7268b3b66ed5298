"""TurboQuantKVCache inside mlx-lm: generate_step, the engine's batches, trim, deepcopy, bytes."""

from __future__ import annotations

import copy

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

from services.core.batch_step import BatchStep
from services.core.kv import (
    BatchTurboQuantKVCache,
    KVCacheSettings,
    TurboQuantKVCache,
    install_turboquant_attention,
    kv_cache_bytes,
    make_kv_cache,
)
from services.core.kv import cache as kv_cache_module
from services.core.sequence_batch import SequenceBatch

ARCHS = ["qwen3_moe", "mixtral", "qwen3_5_moe"]
COMPRESSING = KVCacheSettings(sink_tokens=4, recent_window=8, block_size=8)
PROMPTS = [list(range(100, 140)), list(range(300, 323)), list(range(500, 557))]


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tiny_models):
    model, _ = load(str(tiny_models.checkpoint(request.param, None)))
    install_turboquant_attention(model)
    return request.param, model


@pytest.fixture(params=["per-token", "deferred"])
def aging(request, monkeypatch):
    """Both ways a prefill chunk's compressed tokens are seen: as token by token (CPUs) and
    exact, the chunk aging after its attention (GPUs): services/core/kv/cache.py."""
    monkeypatch.setattr(kv_cache_module, "CHUNK_INVARIANT_PREFILL", request.param == "per-token")
    return request.param


def greedy(model, prompt, cache, n=8):
    steps = generate_step(mx.array(prompt), model, prompt_cache=cache, max_tokens=n, prefill_step_size=16)
    return [token for token, _ in steps]


def test_make_kv_cache_kinds(tiny):
    arch, model = tiny
    fp16 = make_kv_cache(model, "fp16")
    assert [type(c) for c in fp16] == [type(c) for c in make_prompt_cache(model)]
    tq = make_kv_cache(model, "turboquant", COMPRESSING)
    for plain, ours in zip(fp16, tq, strict=True):
        assert isinstance(ours, TurboQuantKVCache if type(plain) is KVCache else type(plain))
    if arch == "qwen3_5_moe":  # Gated DeltaNet layers keep their recurrent state cache
        assert any(isinstance(c, ArraysCache) for c in tq) and any(
            isinstance(c, TurboQuantKVCache) for c in tq
        )
    with pytest.raises(ValueError, match="unknown KV cache kind"):
        make_kv_cache(model, "int8")


def test_uncompressed_turboquant_cache_generates_exactly_like_fp16(tiny):
    _, model = tiny
    exact = KVCacheSettings(recent_window=10_000)  # nothing ages out: the hook must be exact
    assert greedy(model, PROMPTS[0], make_kv_cache(model, "turboquant", exact)) == greedy(
        model, PROMPTS[0], make_kv_cache(model, "fp16")
    )


def test_compressing_cache_is_smaller_and_hook_falls_through_for_fp16(tiny):
    _, model = tiny
    tq = make_kv_cache(model, "turboquant", KVCacheSettings(sink_tokens=4, recent_window=0, block_size=8))
    fp = make_kv_cache(model, "fp16")
    greedy(model, PROMPTS[2], tq)
    greedy(model, PROMPTS[2], fp)
    assert any(c.compressed_length for c in tq if isinstance(c, TurboQuantKVCache))
    tq_bytes = sum(c.nbytes for c in tq if isinstance(c, TurboQuantKVCache))
    fp_bytes = sum(f.nbytes for c, f in zip(tq, fp, strict=True) if isinstance(c, TurboQuantKVCache))
    assert tq_bytes < fp_bytes / 2  # float32 model, head_dim 16: codes + norms vs 4-byte floats
    assert kv_cache_bytes(tq) == sum(c.nbytes for c in tq)


def test_a_batch_matches_one_sequence_at_a_time(tiny, aging):
    _, model = tiny
    alone = [greedy(model, p, make_kv_cache(model, "turboquant", COMPRESSING)) for p in PROMPTS]
    sequences = SequenceBatch(model, max_sequences=3, prefill_chunk=16)
    uids = [sequences.insert([p], 8, make_kv_cache(model, "turboquant", COMPRESSING)) for p in PROMPTS]
    out = {uid: [] for uid in uids}
    saw_batch_cache = False
    while any(len(v) < 8 for v in out.values()):
        step = BatchStep(sequences)
        _, responses = step.finish([task() for task in step.tasks])
        batch = sequences.generation_batch.prompt_cache
        saw_batch_cache |= any(isinstance(c, BatchTurboQuantKVCache) for c in batch)
        for r in responses:
            out[r.uid].append(r.token)
    assert saw_batch_cache
    assert [out[uid] for uid in uids] == alone


def test_deepcopy_is_independent_and_trim_rewinds(tiny, aging):
    _, model = tiny
    cache = make_kv_cache(model, "turboquant", COMPRESSING)
    prompt = PROMPTS[2]
    model(mx.array(prompt)[None], cache=cache)
    layer = next(c for c in cache if isinstance(c, TurboQuantKVCache))
    before = (layer.offset, layer.nbytes, layer.compressed_length)
    twin = copy.deepcopy(cache)
    model(mx.array([7, 8, 9])[None], cache=twin)  # the copy moves on; the original must not
    assert (layer.offset, layer.nbytes, layer.compressed_length) == before

    # Trim deep into the compressed run: the newest 30 tokens leave every run they were in.
    assert all(c.is_trimmable() for c in twin if isinstance(c, TurboQuantKVCache))
    twin_layer = next(c for c in twin if isinstance(c, TurboQuantKVCache))
    trimmed = {c.trim(33) for c in twin if isinstance(c, TurboQuantKVCache)}
    assert trimmed == {33}
    assert twin_layer.offset == len(prompt) - 30 and twin_layer.compressed_length < before[2]
    assert twin_layer.nbytes < before[1]


def test_trim_and_refeed_reproduces_the_logits(tiny, aging):
    """Prefix reuse: rewind a cache and feed the same tokens again. With every token kept
    exact the logits must be identical (the rewound compressed run is covered above)."""
    _, model = tiny
    cache = make_kv_cache(model, "turboquant", KVCacheSettings(recent_window=10_000))
    if any(not isinstance(c, TurboQuantKVCache) for c in cache):
        pytest.skip("recurrent (Gated DeltaNet) state cannot be rewound; mlx-lm refuses it too")
    prompt = PROMPTS[2]
    model(mx.array(prompt)[None], cache=cache)
    reference = model(mx.array([5])[None], cache=copy.deepcopy(cache))
    for c in cache:
        c.trim(20)
    model(mx.array(prompt[-20:])[None], cache=cache)
    assert mx.allclose(model(mx.array([5])[None], cache=cache), reference, atol=1e-5).item()
