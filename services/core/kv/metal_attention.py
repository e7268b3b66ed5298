"""Decode-time attention over a TurboQuant cache with fused kernels, when this device has
a backend that passed its self-check against the twin.

Same numbers as `turboquant_attention` (the twin): scores of compressed keys come from
the packed codes (the backend's `key_scores`), one softmax covers all runs, compressed
values are summed from their codes in the rotated domain (`weighted_values`) and rotated
back once. No decompressed copy of the cache exists at any point.

The backend is kernel_select.py's choice for this device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

from services.core.expert_link.in_flight import settle_pending
from services.core.kv import kernel_select

if TYPE_CHECKING:
    from services.core.kv.cache import TurboQuantKVCache


def decoded_run(key_codec, value_codec, keys, values, dtype) -> tuple[mx.array, mx.array]:
    """A compressed run decoded into the rotated domain for one prefill call: (estimated keys,
    values), [B, H, T, P] of `dtype`. One kernel (and one matmul for QJL keys) where the
    backend has one; the twin's ~25 array ops otherwise (what a GPU prefill spent most of its
    time over fp16 on, bench/kv_attention.py --prefill-paths)."""
    fused = getattr(kernel_select.kernel_backend(), "decoded_run", None)
    out = None if fused is None else fused(key_codec, value_codec, keys, values, dtype)
    if out is not None:
        return out
    return key_codec.estimated_keys(keys, dtype), value_codec.decode_rotated(values).astype(dtype)


def kernel_attention(
    queries: mx.array, cache: TurboQuantKVCache, scale: float, start: int
) -> mx.array | None:
    """The step on the backend's kernels; None when they do not serve it (a backend with only
    a fused step that does not fit, e.g. the CPU one past 1024 dims): the twin then does."""
    kernels = kernel_select.kernel_backend()
    if getattr(kernels, "EVALUATES_INPUTS", False):
        settle_pending()  # its inputs may hang on a layer call in flight (services/core/expert_link/in_flight.py)
    fused = getattr(kernels, "decode_attention", None)
    if fused is not None:  # the whole step in one or two kernels, where the backend has them
        out = fused(queries, cache, scale, start)
        if out is not None or not hasattr(kernels, "key_scores"):
            return out
    return composed_attention(kernels, queries, cache, scale, start)


def composed_attention(
    kernels, queries: mx.array, cache: TurboQuantKVCache, scale: float, start: int
) -> mx.array:
    """Attention from `kernels`' key_scores and weighted_values (any number of queries, query
    row i at position start + i): one softmax over every run's scores, compressed values
    summed from their codes in the rotated domain. The scores are [B, Hq, L, offset] floats;
    no decompressed copy of the cache is made here (`kernels` decides how it reads codes)."""
    B, n_q_heads, L, D = queries.shape
    n_kv_heads = cache.kv_heads
    rep = n_q_heads // n_kv_heads
    q = (queries.astype(mx.float32) * scale).reshape(B, n_kv_heads, rep * L, D)
    runs = [
        ("sink", cache.sink_keys, cache.sink_values),
        ("compressed", cache.compressed_keys, cache.compressed_values),
        ("recent", cache.recent_keys, cache.recent_values),
    ]
    runs = [r for r in runs if r[1] is not None and (r[0] == "compressed" or r[1].shape[2])]
    scores = []
    for name, keys, _ in runs:
        if name == "compressed":
            scores.append(kernels.key_scores(cache.key_codec, cache.key_codec.rotate_queries(q), keys))
        else:
            scores.append(q @ keys.astype(mx.float32).swapaxes(-1, -2))
    scores = mx.concatenate(scores, axis=-1) if len(scores) > 1 else scores[0]
    if L > 1 or start + L > cache.offset:
        query_pos = start + mx.arange(L)
        visible = (query_pos[:, None] >= mx.arange(cache.offset)[None]) | (query_pos[:, None] >= cache.offset)
        scores = mx.where(mx.tile(visible, (rep, 1)), scores, mx.finfo(mx.float32).min)
    weights = mx.softmax(scores, axis=-1, precise=True)
    out, begin = None, 0
    for name, keys, values in runs:
        length = keys.length if name == "compressed" else keys.shape[2]
        w = weights[..., begin : begin + length]
        begin += length
        if name == "compressed":
            term = cache.value_codec.unrotate(kernels.weighted_values(cache.value_codec, w, values))
        else:
            term = w @ values.astype(mx.float32)
        out = term if out is None else out + term
    return out.reshape(B, n_q_heads, L, -1).astype(queries.dtype)
