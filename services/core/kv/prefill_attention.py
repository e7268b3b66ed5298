"""Prefill attention over a long compressed run without a decompressed copy of the cache.

The twin's prefill path (`attention._stored_attention`) decodes the whole compressed run
for each call and runs MLX's fused attention over it: fast, but the transient copy grows
with the context (at 128K tokens, 128-wide heads and 8 KV heads, 512 MB per layer in fp16).
Here a prefill chunk is split into query chunks whose scores fit `SCORES_BUDGET_BYTES`, and
each chunk's attention is composed from key_scores and weighted_values
(`metal_attention.composed_attention`): on a GPU backend straight from the codes, on the
twin `BLOCK_TOKENS` compressed tokens at a time (`BlockwiseTwin`).
"""

from __future__ import annotations

import mlx.core as mx

from services.core.kv.metal_attention import composed_attention

# float32 scores one query chunk may hold ([B, Hq, queries, offset]); bounds the transient
SCORES_BUDGET_BYTES = 64 << 20
# compressed tokens the twin decodes at a time; runs up to this long keep the fused path
BLOCK_TOKENS = 4096


class BlockwiseTwin:
    """The twin behind the key_scores / weighted_values contracts (metal/backend.py), reading
    a compressed run `block` tokens at a time, so only one decoded block exists at once."""

    def __init__(self, block: int = BLOCK_TOKENS):
        self.block = block

    def _spans(self, length: int):
        return [(a, min(a + self.block, length)) for a in range(0, length, self.block)]

    def key_scores(self, codec, rotated_queries: mx.array, tokens) -> mx.array:
        parts = [
            codec.key_scores(rotated_queries, tokens.tokens(a, b)) for a, b in self._spans(tokens.length)
        ]
        return mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]

    def weighted_values(self, codec, weights: mx.array, tokens) -> mx.array:
        total = None
        for a, b in self._spans(tokens.length):
            block = tokens.tokens(a, b)
            part = (weights[..., a:b] * block.norm.astype(mx.float32)[..., None, :]) @ codec.centroid_values(
                block
            )
            total = part if total is None else total + part
        return total


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


def prefill_kernels(cache):
    """What composes a prefill over `cache`'s compressed run: the device's kernel backend where
    it scores codes directly (GPUs), the block-by-block twin where the run is longer than
    BLOCK_TOKENS, else None (the twin's fused path, whose transient copy is then at most
    BLOCK_TOKENS tokens)."""
    from services.core.kv.metal_attention import kernel_backend

    kernels = kernel_backend()
    if kernels is not None and hasattr(kernels, "key_scores"):
        return kernels
    return BlockwiseTwin() if cache.compressed_length > BLOCK_TOKENS else None
