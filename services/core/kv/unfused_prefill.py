"""Prefill chunks on CUDA without a cuDNN graph for every new shape.

On MLX's CUDA backend, `mx.fast.scaled_dot_product_attention` with more than one query runs
cuDNN's fused attention, and MLX builds a cuDNN graph (its kernels compiled) for every new
combination of batch rows, query length, key length, strides and mask shape. That build costs
tens of ms, against a few ms for the chunk itself. A server meets new shapes all the time:
requests join the batch in groups whose sizes depend on when they arrive, prompt lengths vary,
a prefix-cache hit leaves a suffix of any length over a cached run of any length.

Here a prefill chunk whose scores are small runs as plain ops instead: two matmuls and a
softmax, which MLX runs without a per-shape build. Larger chunks keep the fused kernel: their
scores would be large, and their own time dwarfs a build. CPUs and Apple GPUs build nothing per
shape and keep the fused kernel always.
"""

from __future__ import annotations

import functools

import mlx.core as mx

# Score bytes (rows x query heads x queries x keys, in the queries' dtype) up to which a
# prefill chunk runs unfused on CUDA: 128 MB holds 16 rows x 32 heads x 16 queries x 8K keys.
UNFUSED_SCORE_BYTES = 128 << 20


@functools.cache
def cuda_available() -> bool:
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available())


def _on_cuda() -> bool:
    return cuda_available() and mx.default_device() == mx.gpu


def unfused_wanted(queries: mx.array, keys: mx.array) -> bool:
    """Whether this attention call is a prefill chunk small enough to run unfused, on CUDA."""
    rows, heads, length, _ = queries.shape
    if length <= 1 or not _on_cuda():
        return False
    return rows * heads * length * keys.shape[2] * queries.dtype.size <= UNFUSED_SCORE_BYTES


def unfused_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask) -> mx.array:
    """softmax(q k^T * scale + mask) v for queries [B, Hq, L, D] over keys and values
    [B, Hkv, S, D] (Hq a multiple of Hkv); `mask` as mlx-lm passes it: None, "causal" (the
    queries are the last L positions) or an array (bool: keep; else added to the scores)
    broadcasting to [B, 1, L, S]. The recipe of mlx-lm's quantized attention, unquantized."""
    rows, q_heads, length, dims = queries.shape
    kv_heads = keys.shape[1]
    repeats = q_heads // kv_heads
    queries = queries * scale
    if repeats > 1:
        queries = queries.reshape(rows, kv_heads, repeats, length, dims)
        keys, values = mx.expand_dims(keys, -3), mx.expand_dims(values, -3)
    scores = queries @ keys.swapaxes(-1, -2)
    if mask is not None:
        if isinstance(mask, str):
            total = scores.shape[-1]
            mask = mx.arange(total - length, total)[:, None] >= mx.arange(total)[None]
        if repeats > 1 and mask.ndim > 3:
            mask = mx.expand_dims(mask, -3)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    out = mx.softmax(scores, axis=-1, precise=True) @ values
    return out.reshape(rows, q_heads, length, dims) if repeats > 1 else out
