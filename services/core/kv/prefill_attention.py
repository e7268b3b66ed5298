"""Prefill attention over a long compressed run without a decompressed copy of the cache.

The twin's prefill path (`attention._stored_attention`) decodes the whole compressed run
for each call and runs MLX's fused attention over it: fast, but the transient copy grows
with the context (at 128K tokens, 128-wide heads and 8 KV heads, 512 MB per layer in fp16).
On a GPU backend a prefill chunk is split into query chunks whose scores fit
`SCORES_BUDGET_BYTES`, each composed from the kernels' key_scores and weighted_values
(`metal_attention.composed_attention`), straight from the codes. On the twin, a run longer
than BLOCK_TOKENS is read one block at a time under an online softmax (`blockwise_attention`).
"""

from __future__ import annotations

import mlx.core as mx

from services.core.kv import metal_attention
from services.core.kv.metal_attention import composed_attention

# float32 scores one query chunk may hold ([B, Hq, queries, offset]); bounds the transient
SCORES_BUDGET_BYTES = 64 << 20
# compressed tokens the twin decodes at a time; runs up to this long keep the fused path
BLOCK_TOKENS = 4096


def blockwise_attention(
    queries: mx.array, cache, scale: float, start: int, block: int | None = None
) -> mx.array:
    """The twin's attention for queries [B, Hq, L, D] at positions start.., with the compressed
    run decoded `block` tokens at a time (default BLOCK_TOKENS): an online softmax walks the
    runs in token order (sinks, compressed blocks, recent window), keeping each row's running
    max, sum and value sums (compressed values summed rotated, rotated back once), so only one
    decoded block and its [rows, block] scores exist at a time, and each block is decoded once."""
    block = block or BLOCK_TOKENS
    B, n_q_heads, L, D = queries.shape
    key_codec, value_codec = cache.key_codec, cache.value_codec
    n_kv_heads = cache.kv_heads
    rep = n_q_heads // n_kv_heads
    q = (queries.astype(mx.float32) * scale).reshape(B, n_kv_heads, rep * L, D)
    rotated_q = key_codec.rotate_queries(q)
    query_pos = mx.tile(start + mx.arange(L), (rep,))[:, None]  # rows are (repeat, query)
    lowest = mx.finfo(mx.float32).min
    running_max = mx.full((B, n_kv_heads, rep * L, 1), lowest, mx.float32)
    total = mx.zeros_like(running_max)
    sums = {"exact": None, "rotated": None}

    def absorb(scores, first: int, values, domain: str) -> None:
        nonlocal running_max, total
        positions = first + mx.arange(scores.shape[-1])[None]
        visible = (query_pos >= positions) | (query_pos >= cache.offset)  # padding rows see all
        scores = mx.where(visible, scores, lowest)
        new_max = mx.maximum(running_max, scores.max(axis=-1, keepdims=True))
        correction = mx.exp(running_max - new_max)
        weights = mx.where(visible, mx.exp(scores - new_max), 0.0)
        total = total * correction + weights.sum(axis=-1, keepdims=True)
        for name in sums:
            if sums[name] is not None:
                sums[name] = sums[name] * correction
        term = values(weights)
        sums[domain] = term if sums[domain] is None else sums[domain] + term
        running_max = new_max

    n_sinks = 0 if cache.sink_keys is None else cache.sink_keys.shape[2]
    if n_sinks:
        keys, values = cache.sink_keys.astype(mx.float32), cache.sink_values.astype(mx.float32)
        absorb(q @ keys.swapaxes(-1, -2), 0, lambda w, v=values: w @ v, "exact")
    run = cache.compressed_keys
    value_run = cache.compressed_values
    for a in range(0, run.length, block):
        b = min(a + block, run.length)
        keys_block, values_block = run.tokens(a, b), value_run.tokens(a, b)
        estimated = key_codec.estimated_keys(keys_block)  # QJL folded in: one score matmul
        absorb(
            rotated_q @ estimated.swapaxes(-1, -2),
            n_sinks + a,
            lambda w, v=value_codec.decode_rotated(values_block): w @ v,
            "rotated",
        )
    recent = cache.recent_keys
    if recent is not None and recent.shape[2]:
        keys, values = recent.astype(mx.float32), cache.recent_values.astype(mx.float32)
        absorb(q @ keys.swapaxes(-1, -2), n_sinks + run.length, lambda w, v=values: w @ v, "exact")
    out = value_codec.unrotate(sums["rotated"])
    if sums["exact"] is not None:
        out = out + sums["exact"]
    return (out / total).reshape(B, n_q_heads, L, -1).astype(queries.dtype)


def chunked_attention(kernels, queries: mx.array, cache, scale: float, start: int) -> mx.array:
    """softmax(q k^T scale + causal mask) v for queries [B, Hq, L, D] at positions start..,
    in query chunks whose float32 scores stay within SCORES_BUDGET_BYTES.

    Chunks hold a power of two of queries and the last one is padded with zero queries (at
    positions past the cache's end, whose rows are dropped): GPU kernels are compiled per
    query count, so a handful of counts serve every prompt length and context."""
    B, n_q_heads, L, D = queries.shape
    fits = max(1, SCORES_BUDGET_BYTES // (4 * B * n_q_heads * max(cache.offset, 1)))
    step = min(1 << (fits.bit_length() - 1), 1 << (L - 1).bit_length())
    padded = -(-L // step) * step
    if padded > L:
        queries = mx.concatenate([queries, mx.zeros((B, n_q_heads, padded - L, D), queries.dtype)], axis=2)
    outs = [
        composed_attention(kernels, queries[:, :, i : i + step], cache, scale, start + i)
        for i in range(0, padded, step)
    ]
    out = mx.concatenate(outs, axis=2) if len(outs) > 1 else outs[0]
    return out[:, :, :L] if padded > L else out


def prefill_kernels():
    """The device's kernel backend where it scores codes directly (GPUs), else None."""
    kernels = metal_attention.kernel_backend()
    return kernels if kernels is not None and hasattr(kernels, "key_scores") else None
