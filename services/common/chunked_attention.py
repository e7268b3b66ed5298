"""Llama 4's chunked attention on caches that mlx-lm's batch classes can merge.

mlx-lm's `llama4` keeps each chunked-attention layer (three layers in four) in a `ChunkedKVCache`,
which has no batch form, and computes masks and attention temperature from one scalar offset. Core's
engine batches sequences, so here every layer keeps a plain `KVCache` (a `BatchKVCache` once
batched), and each chunked layer's mask is built from the cache's own positions, row by row: a
query attends to the keys at or before it within its chunk of `attention_chunk_size` positions.
That is mlx-lm's math: `ChunkedKVCache` drops only keys that its mask hides anyway. The cost is
memory: a chunked layer holds a sequence's whole context rather than its last chunk.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import llama4
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.cache import KVCache

from services.common.mlx_lm_adapter import write_index


def _slots(cache, n: int) -> tuple[int, mx.array | None]:
    """The cache slot the next `n` tokens start at, and each row's left padding (None: none)."""
    if cache is None:
        return 0, None
    if hasattr(cache, "left_padding"):  # BatchKVCache: rows right-aligned, left-padded
        return write_index(cache), cache.left_padding
    return int(cache.offset), None


def chunk_mask(cache, n: int, chunk: int) -> mx.array:
    """[B or 1, 1, n, start + n] bool: query i sees key j iff j is at or before i, in i's chunk,
    and not padding."""
    start, padding = _slots(cache, n)
    keys = mx.arange(start + n)[None]
    queries = mx.arange(start, start + n)[:, None]
    if padding is not None:
        padding = padding[:, None, None, None]
        keys, queries = keys - padding, queries - padding
    return (keys <= queries) & (keys >= 0) & ((keys // chunk) == (queries // chunk))


def _row_positions(offset, n: int) -> mx.array:
    """Positions of the next `n` tokens: [n] for one scalar offset, [B, 1, n] for one per row."""
    steps = mx.arange(n)
    if isinstance(offset, mx.array) and offset.ndim == 1:
        return offset[:, None, None] + steps
    return steps + offset


class BatchChunkedAttention(llama4.Attention):
    """mlx-lm's Llama 4 attention, with the NoPE layers' temperature taken per row."""

    @property
    def attends_in_chunks(self) -> bool:
        """Whether this layer's mask is chunked (the RoPE layers), not plain causal."""
        return bool(self.use_rope)

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        B, L, _ = x.shape
        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        queries = queries.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        keys = keys.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        values = values.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        offset = 0 if cache is None else cache.offset
        if self.use_rope:
            queries = self.rope(queries, offset=offset)
            keys = self.rope(keys, offset=offset)
        if self.use_qk_norm:
            queries = mx.fast.rms_norm(queries, weight=None, eps=1e-6)
            keys = mx.fast.rms_norm(keys, weight=None, eps=1e-6)
        if self.attn_temperature_tuning and not self.use_rope:
            # a left-padded row's padding sits at negative positions: scaled as position 0
            positions = mx.maximum(_row_positions(offset, L) + 1, 0)
            scales = mx.log(mx.floor(positions / self.floor_scale) + 1.0) * self.attn_scale + 1.0
            queries = (queries * scales[..., None]).astype(queries.dtype)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        output = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1))


class BatchChunkedLlamaModel(llama4.LlamaModel):
    """mlx-lm's Llama 4 text model over plain caches, masks built per row (`chunk_mask`)."""

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        h = self.embed_tokens(inputs)
        caches = cache if cache is not None else [None] * len(self.layers)
        chunked = [layer.self_attn.attends_in_chunks for layer in self.layers]
        n = h.shape[1]
        global_mask = create_attention_mask(h, caches[chunked.index(False)] if False in chunked else None)
        local_mask = global_mask
        if True in chunked:
            first = caches[chunked.index(True)]
            # within the first chunk the chunked mask is the causal one
            if _slots(first, n)[0] + n > self.attention_chunk_size:
                local_mask = chunk_mask(first, n, self.attention_chunk_size)
            else:
                local_mask = create_attention_mask(h, first)
        for layer, layer_cache, in_chunks in zip(self.layers, caches, chunked, strict=True):
            h = layer(h, local_mask if in_chunks else global_mask, cache=layer_cache)
        return self.norm(h)


def with_batch_chunked_attention(model_class):
    """mlx-lm's llama4 Model, its attention and text model swapped for the classes above (same
    parameters) and a plain KVCache for every layer."""

    class Model(model_class):
        def __init__(self, args):
            super().__init__(args)
            text = self.language_model.model
            text.__class__ = BatchChunkedLlamaModel
            for layer in text.layers:
                layer.self_attn.__class__ = BatchChunkedAttention

        def make_cache(self):
            return [KVCache() for _ in self.layers]

    Model.__name__ = Model.__qualname__ = model_class.__name__
    return Model
