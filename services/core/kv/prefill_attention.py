"""Prefill attention over a compressed run whose decoded copy would be too large.

A prefill chunk normally runs through one fused mx.fast.scaled_dot_product_attention over
the run decoded for that call into the rotated domain (`attention._stored_attention`): on
a GPU the fused call is several times faster than any composition that keeps the scores in
memory (docs/benchmarks.md, TurboQuant speed). The decoded copy is transient, one layer at a time, but grows with the context, so a run whose
copy would exceed DECODED_BUDGET_BYTES is read block by block under an online softmax
(`blockwise_attention`), each block no larger than the budget.
"""

from __future__ import annotations

import mlx.core as mx

from services.core.kv.metal_attention import decoded_run

# the most transient memory a prefill call's decoded copy of one layer's compressed run may
# take (keys and values; block by block, with the block's float32 scores): 512 MB holds the
# decoded run of 128K tokens of 8 KV heads x 128 dims in float16
DECODED_BUDGET_BYTES = 512 << 20


def prefill_dtype(queries: mx.array):
    """The dtype a prefill decodes into: the model's on a GPU (its matrix units), float32 on
    a CPU (where MLX has no fast half-precision matmul)."""
    return mx.float32 if mx.default_device() == mx.cpu else queries.dtype


def decoded_bytes_per_token(cache, dtype) -> int:
    """Bytes a call's decoded copy of the compressed run takes per token (keys and values)."""
    batch, heads = cache.compressed_keys.norm.shape[:2]
    return batch * heads * (cache.key_codec.padded + cache.value_codec.padded) * dtype.size


def decoded_run_fits(cache, dtype) -> bool:
    """Whether a call's decoded copy of the whole compressed run fits DECODED_BUDGET_BYTES (the
    fused path), or the run must be read block by block."""
    if not cache.compressed_length:
        return True
    return cache.compressed_length * decoded_bytes_per_token(cache, dtype) <= DECODED_BUDGET_BYTES


def block_tokens(cache, queries: mx.array, dtype) -> int:
    """Compressed tokens per block such that a block's decoded keys and values and its float32
    scores for `queries` fit DECODED_BUDGET_BYTES."""
    scores = 4 * queries.shape[0] * queries.shape[1] * queries.shape[2]
    return max(1, DECODED_BUDGET_BYTES // (decoded_bytes_per_token(cache, dtype) + scores))


def blockwise_attention(
    queries: mx.array, cache, scale: float, start: int, block: int | None = None, dtype=mx.float32
) -> mx.array:
    """Attention for queries [B, Hq, L, D] at positions start.., with the compressed run
    decoded `block` tokens at a time (default: `block_tokens`): an online softmax walks the
    runs in token order (sinks, compressed blocks, recent window), keeping each row's running
    max, sum and value sums (compressed values summed rotated, rotated back once), so only one
    decoded block and its [rows, block] scores exist at a time, and each block is decoded once.
    The score and value matmuls run in `dtype` (a GPU's half type reaches its matrix units;
    softmax statistics and sums stay float32)."""
    block = block or block_tokens(cache, queries, dtype)
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
        scores = scores.astype(mx.float32)
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
        term = values(weights.astype(dtype)).astype(mx.float32)
        sums[domain] = term if sums[domain] is None else sums[domain] + term
        running_max = new_max

    q, rotated_q = q.astype(dtype), rotated_q.astype(dtype)
    n_sinks = 0 if cache.sink_keys is None else cache.sink_keys.shape[2]
    if n_sinks:
        keys, values = cache.sink_keys.astype(dtype), cache.sink_values.astype(dtype)
        absorb(q @ keys.swapaxes(-1, -2), 0, lambda w, v=values: w @ v, "exact")
    run = cache.compressed_keys
    value_run = cache.compressed_values
    for a in range(0, run.length, block):
        b = min(a + block, run.length)
        # QJL folded into the estimated keys: one score matmul
        estimated, decoded = decoded_run(
            key_codec, value_codec, run.tokens(a, b), value_run.tokens(a, b), dtype
        )
        absorb(rotated_q @ estimated.swapaxes(-1, -2), n_sinks + a, lambda w, v=decoded: w @ v, "rotated")
    recent = cache.recent_keys
    if recent is not None and recent.shape[2]:
        keys, values = recent.astype(dtype), cache.recent_values.astype(dtype)
        absorb(q @ keys.swapaxes(-1, -2), n_sinks + run.length, lambda w, v=values: w @ v, "exact")
    out = value_codec.unrotate(sums["rotated"])
    if sums["exact"] is not None:
        out = out + sums["exact"]
    return (out / total).reshape(B, n_q_heads, L, -1).astype(queries.dtype)
