"""Attention over a TurboQuant cache, computed in the rotated domain (the pure-MLX twin
of the Metal kernels), and the hook that lets mlx-lm's unchanged attention code use it.

Scores of the compressed run come straight from the codes (`TurboQuantCodec.key_scores`);
exact runs (sinks, recent window) are scored normally; one softmax covers all runs in
position order; compressed values are summed as centroids in the rotated domain and
the sum is rotated back once. The cache stays compressed: only the centroid values of
the run being scored exist transiently during the step.
"""

from __future__ import annotations

import sys

import mlx.core as mx
from mlx_lm.models import base as mlx_base

from services.core.kv.cache import TurboQuantKVCache

_HOOK_MARK = "_moe_mesh_turboquant"


def turboquant_attention(
    queries: mx.array, cache: TurboQuantKVCache, scale: float, query_start: int | None = None
) -> mx.array:
    """softmax(q k^T * scale + causal mask) v over everything `cache` holds.

    queries: [B, Hq, L, D] after RoPE; query i sits at position query_start + i
    (default: the last L positions of the cache). Queries past the cache's end see
    every key (their rows are padding in a batch and are never read)."""
    B, n_q_heads, L, D = queries.shape
    if cache.offset == 0:
        return mx.zeros_like(queries)
    n_kv_heads = _first(cache).shape[1]
    rep = n_q_heads // n_kv_heads
    q = (queries * scale).reshape(B, n_kv_heads, rep * L, D)  # GQA: q head = kv * rep + r

    parts, scores = [], []
    if cache.sink_keys is not None:
        parts.append("sink")
        scores.append((q @ cache.sink_keys.swapaxes(-1, -2).astype(q.dtype)).astype(mx.float32))
    if cache.compressed_keys is not None:
        parts.append("compressed")
        rotated = cache.key_codec.rotate_queries(q)
        scores.append(cache.key_codec.key_scores(rotated, cache.compressed_keys))
    if cache.recent_keys is not None:
        parts.append("recent")
        scores.append((q @ cache.recent_keys.swapaxes(-1, -2).astype(q.dtype)).astype(mx.float32))
    lengths = [s.shape[-1] for s in scores]
    scores = mx.concatenate(scores, axis=-1) if len(scores) > 1 else scores[0]

    start = cache.offset - L if query_start is None else query_start
    if L > 1 or start + L > cache.offset:
        query_pos = start + mx.arange(L)
        visible = query_pos[:, None] >= mx.arange(cache.offset)[None, :]
        visible = visible | (query_pos[:, None] >= cache.offset)  # padding rows: see all
        visible = mx.tile(visible, (rep, 1))
        scores = mx.where(visible, scores, mx.finfo(mx.float32).min)
    weights = mx.softmax(scores, axis=-1, precise=True)

    out = None
    begin = 0
    for part, length in zip(parts, lengths, strict=True):
        w = weights[..., begin : begin + length]
        begin += length
        if part == "compressed":
            values = cache.compressed_values
            scaled = w * values.norm.astype(mx.float32)[..., None, :]
            term = cache.value_codec.unrotate(scaled @ cache.value_codec.centroid_values(values))
        else:
            exact = cache.sink_values if part == "sink" else cache.recent_values
            term = w.astype(exact.dtype) @ exact
        out = term if out is None else out + term
    return out.reshape(B, n_q_heads, L, -1).astype(queries.dtype)


def _first(cache: TurboQuantKVCache) -> mx.array:
    for item in (cache.sink_keys, cache.recent_keys):
        if item is not None:
            return item
    return cache.compressed_keys.norm[..., None]


def _attention_for(cache, queries: mx.array, scale: float) -> mx.array | None:
    from services.core.kv.batch_cache import BatchTurboQuantKVCache

    if isinstance(cache, TurboQuantKVCache):
        return turboquant_attention(queries, cache, scale)
    if isinstance(cache, BatchTurboQuantKVCache):
        return cache.attention(queries, scale)
    return None


def make_hooked_sdpa(original):
    """mlx-lm's scaled_dot_product_attention with TurboQuant caches routed to the twin
    (or the Metal kernels); every other cache takes the original path untouched."""

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        if sinks is None:
            out = _attention_for(cache, queries, scale)
            if out is not None:
                return out
        elif isinstance(cache, TurboQuantKVCache) or type(cache).__name__ == "BatchTurboQuantKVCache":
            raise ValueError("TurboQuant attention does not support attention sinks arrays")
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    setattr(scaled_dot_product_attention, _HOOK_MARK, True)
    return scaled_dot_product_attention


def install_turboquant_attention(model) -> list[str]:
    """Route attention over TurboQuant caches in every mlx-lm module the model's layers
    come from. Idempotent; returns the module names patched (new ones only).

    mlx-lm model files import `scaled_dot_product_attention` by name from
    mlx_lm.models.base, so the name is wrapped in each such module (and in base); the
    wrapper falls through to the original for every other cache type."""
    if getattr(model, _HOOK_MARK, False):
        return []
    names = {type(m).__module__ for m in model.modules()} | {mlx_base.__name__}
    patched = []
    for name in sorted(names):
        module = sys.modules.get(name)
        current = getattr(module, "scaled_dot_product_attention", None)
        if current is None or getattr(current, _HOOK_MARK, False):
            continue
        module.scaled_dot_product_attention = make_hooked_sdpa(current)
        patched.append(name)
    object.__setattr__(model, _HOOK_MARK, True)  # a plain attribute, not a parameter
    return patched
