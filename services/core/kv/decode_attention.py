"""Decode-step attention over a TurboQuant cache as one compiled MLX graph.

For a few queries at the end of the sequence (decode steps, L <= 8) the cost is the
compressed run: per step it is decoded block-free in three table gathers (key centroids,
QJL signs, value centroids; `packing.lookup_decode`) and consumed by three matmuls, all
in the rotated domain:

    scores = |k| (Fq . c_k + |r| (S Fq) . qjl_scale sign(S r))       (unbiased <q, k>)
    out    = F^T sum_t w_t |v_t| c_v,t

Exact runs (sinks, recent window) are scored as stored. The whole step is one
`mx.compile`d function of whole buffers (`TokenBuffer`), with the filled lengths passed
as array values and applied as a mask: its shapes change only when a buffer grows, so
the compiled graph (fused element-wise work, no per-op Python) is reused step after
step. Masked slots get exactly zero weight, so the numbers are those of attention over
the filled parts alone, up to float rounding. Nothing decoded outlives the call.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from services.core.kv.packing import lookup_decode

_MASKED = float(mx.finfo(mx.float32).min)


def _pad(x: mx.array, size: int) -> mx.array:
    if x.shape[-1] == size:
        return x
    return mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])


@lru_cache(maxsize=64)
def _compiled_step(scale: float, key_bits: int, value_bits: int, qjl: bool, runs: tuple[bool, bool, bool]):
    has_sinks, has_compressed, has_recent = runs

    def step(queries, lengths, sinks, compressed, recent, constants):
        B, n_q_heads, L, D = queries.shape
        exact = sinks or recent
        n_kv_heads = exact[0].shape[1] if exact else compressed[0].shape[1]
        rep = n_q_heads // n_kv_heads
        q = queries.astype(mx.float32).reshape(B, n_kv_heads, rep * L, D) * scale
        # position of each query row (rows are rep groups of L) and of each cache slot
        sink_len, compressed_len, recent_len = lengths[0], lengths[1], lengths[2]
        offset = sink_len + compressed_len + recent_len
        query_pos = mx.tile(offset - L + mx.arange(L), (rep,))[:, None]
        scores, exact_values, packed_values = [], None, None
        if has_compressed:
            rotation, qjl_t, key_table, sign_table, value_table, unrotation = constants
            norm, codes = compressed[0], compressed[1]
            rotated = _pad(q, rotation.shape[0]) @ rotation
            s = rotated @ lookup_decode(codes, key_bits, key_table).swapaxes(-1, -2)
            if qjl:
                residual_norm, signs = compressed[2], compressed[3]
                signs = lookup_decode(signs, 1, sign_table)
                s = (
                    s
                    + ((rotated @ qjl_t) @ signs.swapaxes(-1, -2))
                    * residual_norm.astype(mx.float32)[..., None, :]
                )
            s = s * norm.astype(mx.float32)[..., None, :]
            slot = mx.arange(norm.shape[-1])
            visible = (slot < compressed_len) & (sink_len + slot <= query_pos)
            scores.append(mx.where(visible, s, _MASKED))
            packed_values = compressed[-2:]
        if exact:
            # sinks and window scored as one run (softmax does not care about order):
            # slot i < sinks is position i; the window's slot j is sinks + compressed + j
            keys = mx.concatenate([sinks[0], recent[0]], axis=2) if has_sinks and has_recent else exact[0]
            exact_values = (
                mx.concatenate([sinks[1], recent[1]], axis=2) if has_sinks and has_recent else exact[1]
            )
            s = q @ keys.astype(mx.float32).swapaxes(-1, -2)
            slot = mx.arange(keys.shape[2])
            in_window = slot >= sink_len
            position = mx.where(in_window, slot + compressed_len, slot)
            visible = (position <= query_pos) & (slot < sink_len + recent_len)
            scores.append(mx.where(visible, s, _MASKED))
        weights = mx.softmax(
            mx.concatenate(scores, axis=-1) if len(scores) > 1 else scores[0], axis=-1, precise=True
        )
        out = None
        if packed_values is not None:
            value_norm, value_codes = packed_values
            length = value_norm.shape[-1]
            w = weights[..., :length] * value_norm.astype(mx.float32)[..., None, :]
            out = ((w @ lookup_decode(value_codes, value_bits, value_table)) @ unrotation)[..., :D]
            weights = weights[..., length:]
        if exact_values is not None:
            term = weights @ exact_values.astype(mx.float32)
            out = term if out is None else out + term
        return out.reshape(B, n_q_heads, L, D).astype(queries.dtype)

    return mx.compile(step)


@lru_cache(maxsize=4096)
def _lengths(sink_length: int, compressed_length: int, recent_length: int) -> mx.array:
    # every layer of a step has the same lengths: one small array per step, not per layer
    return mx.array([sink_length, compressed_length, recent_length], mx.int32)


def decode_attention(queries: mx.array, cache, scale: float) -> mx.array:
    """softmax(q k^T * scale) v for the last L queries of `cache` (a TurboQuantKVCache),
    causal among themselves; the twin's numbers, from the compressed codes."""
    key_codec, value_codec = cache.key_codec, cache.value_codec
    sinks = (cache.sink_keys, cache.sink_values) if cache.sink_keys is not None else ()
    recent = (
        cache.recent_buffer.arrays if cache.recent_buffer is not None and cache.recent_buffer.length else ()
    )
    key_buffer, value_buffer = cache.compressed_key_buffer, cache.compressed_value_buffer
    compressed, constants = (), ()
    if key_buffer is not None:
        values = value_buffer.arrays
        compressed = (*key_buffer.arrays, values[0], values[1])
        constants = (
            key_codec.rotation.matrix,
            key_codec.qjl_matrix_t if key_codec.qjl else key_codec.rotation.matrix,
            key_codec.centroid_table,
            key_codec.sign_table if key_codec.qjl else key_codec.centroid_table,
            value_codec.centroid_table,
            value_codec.rotation.matrix_t,
        )
    lengths = _lengths(
        sinks[0].shape[2] if sinks else 0,
        cache.compressed_length,
        cache.recent_buffer.length if recent else 0,
    )
    step = _compiled_step(
        float(scale),
        key_codec.bits,
        value_codec.bits,
        key_codec.qjl,
        (bool(sinks), bool(compressed), bool(recent)),
    )
    return step(queries, lengths, sinks, compressed, recent, constants)
