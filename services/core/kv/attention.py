"""Attention over a TurboQuant cache, computed in the rotated domain (the pure-MLX twin
of the Metal kernels); sdpa_hook.py routes mlx-lm's unchanged attention code here.

Scores of the compressed run come from the codes (decoded by table lookup inside the
call); exact runs (sinks, recent window) are scored normally; one softmax covers all
runs; compressed values are summed as centroids in the rotated domain and the sum is
rotated back once. The cache stays compressed: decoded values of the compressed run
exist only transiently, inside one attention call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

from services.core.kv.decode_attention import decode_attention
from services.core.kv.kernel_select import kernels_ready
from services.core.kv.metal_attention import decoded_run, kernel_attention
from services.core.kv.prefill_attention import blockwise_attention, decoded_run_fits, prefill_dtype
from services.core.kv.token_buffer import token_length

if TYPE_CHECKING:
    from services.core.kv.cache import TurboQuantKVCache


def turboquant_attention(
    queries: mx.array, cache: TurboQuantKVCache, scale: float, query_start: int | None = None
) -> mx.array:
    """softmax(q k^T * scale + causal mask) v over everything `cache` holds (see
    `_stored_attention`), with the value offset of a value-centred cache added back."""
    out = _stored_attention(queries, cache, scale, query_start)
    offset = cache.value_offset  # [B, H_kv, 1, D] or None, as the values just read were stored
    cache.age()  # what this update left exact for its own queries (cache.CHUNK_INVARIANT_PREFILL)
    if offset is None:
        return out
    # the weights sum to 1, so the offset is added once
    offset = mx.repeat(offset, queries.shape[1] // offset.shape[1], axis=1)
    return (out.astype(mx.float32) + offset).astype(out.dtype)


def _stored_attention(
    queries: mx.array, cache: TurboQuantKVCache, scale: float, query_start: int | None = None
) -> mx.array:
    """softmax(q k^T * scale + causal mask) v over everything `cache` holds.

    queries: [B, Hq, L, D] after RoPE; query i sits at position query_start + i
    (default: the last L positions of the cache). Queries past the cache's end see
    every key (their rows are padding in a batch and are never read).

    While nothing is compressed (a context within the sinks and the window) queries at the end
    take `_exact_attention`, the fp16 cache's own fused call. Where the update that stored these
    queries' tokens compressed some (`cache.just_aged`, kept on CPUs: cache.CHUNK_INVARIANT_PREFILL),
    its earlier queries must see those exact: such runs take `_attention_by_boundary`.
    Otherwise decode steps (L <= 8, the queries at the end) take the fused kernels, else
    `decode_attention`: one compiled
    graph that scores straight from the codes. Longer query runs (prefill) run in the
    rotated domain through one fused mx.fast.scaled_dot_product_attention call: the
    query is rotated once, compressed keys are decoded for this call into the
    estimated key |k| (c + qjl_scale |r| S^T sign(S r)) (one dot product with the
    rotated query is the unbiased estimate), compressed values into |v| c, exact runs
    are rotated (a few hundred tokens), and the output is rotated back once. Where that
    transient copy would exceed prefill_attention.DECODED_BUDGET_BYTES, `blockwise_attention`
    reads the run one block at a time under an online softmax instead (there, the tokens this
    update compressed are seen as stored: at such lengths, chunking shows)."""
    B, n_q_heads, L, D = queries.shape
    if cache.offset == 0:
        return mx.zeros_like(queries)
    start = cache.offset - L if query_start is None else query_start
    if not cache.compressed_length and start + L == cache.offset:
        return _exact_attention(queries, cache, scale)
    # this update compressed tokens that its earlier queries see exact (one query: none)
    aged = cache.just_aged if L > 1 else None
    if L <= 8 and aged is None and cache.compressed_length and kernels_ready():  # (no views built per step)
        out = kernel_attention(queries, cache, scale, start)  # fused kernels: straight from the codes
        if out is not None:
            return out
    if L <= 8 and aged is None and start + L == cache.offset:
        return decode_attention(queries, cache, scale)
    dtype = prefill_dtype(queries)
    if not decoded_run_fits(cache, dtype):
        return blockwise_attention(queries, cache, scale, start, dtype=dtype)  # a block at a time
    keys_codec, values_codec = cache.key_codec, cache.value_codec
    q = keys_codec.rotate_queries(queries).astype(dtype)
    if aged is not None:
        out = _attention_by_boundary(q, cache, scale, start, dtype)
        return values_codec.unrotate(out.astype(mx.float32)).astype(queries.dtype)
    keys, values = [], []
    for exact_k, exact_v, packed_k, packed_v in (
        (cache.sink_keys, cache.sink_values, None, None),
        (None, None, cache.compressed_keys, cache.compressed_values),
        (cache.recent_keys, cache.recent_values, None, None),
    ):
        if exact_k is not None and exact_k.shape[2]:
            keys.append(keys_codec.rotation.forward(exact_k).astype(dtype))
            values.append(values_codec.rotation.forward(exact_v).astype(dtype))
        elif packed_k is not None:
            run_keys, run_values = decoded_run(keys_codec, values_codec, packed_k, packed_v, dtype)
            keys.append(run_keys)
            values.append(run_values)
    keys, values = _along_tokens(keys), _along_tokens(values)

    if start + L == cache.offset:
        # the queries are the newest tokens: bottom-right causal, which lets MLX use its
        # fused kernel instead of materialising [L, offset] scores against an array mask
        mask = "causal" if L > 1 else None
    else:
        query_pos = start + mx.arange(L)
        mask = query_pos[:, None] >= mx.arange(cache.offset)[None, :]
        mask = mask | (query_pos[:, None] >= cache.offset)  # padding rows: see all
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
    return values_codec.unrotate(out.astype(mx.float32)).astype(queries.dtype)


def compressed_boundaries(cache: TurboQuantKVCache, start: int, L: int) -> mx.array:
    """[L] int: for each query position start + i, where the compressed run ended when the cache
    held the tokens up to it, had they come one at a time (the cache compresses whole blocks once
    the window holds recent_window + block_size tokens, so this is a function of the position
    alone), but never before the first token the last update compressed (older ones were
    compressed already) nor past the run."""
    s, sinks = cache.settings, token_length(cache.sink_keys)
    _, _, first_aged = cache.just_aged
    position = start + mx.arange(L)
    grown = ((position + 1 - sinks - s.recent_window) // s.block_size) * s.block_size
    return mx.clip(sinks + grown, first_aged, sinks + cache.compressed_length)


def _attention_by_boundary(
    q: mx.array, cache: TurboQuantKVCache, scale: float, start: int, dtype
) -> mx.array:
    """Rotated-domain attention of rotated queries q [B, Hq, L, P] (positions start..) over a
    cache whose last update compressed tokens (`cache.just_aged`): each query sees what it would
    have seen had the prompt come one token at a time, the tokens compressed by its own position
    from their codes and the rest exact (the update's exact copies of what it compressed). Then a
    prompt's tokens do not depend on how it was cut into prefill chunks, which follows the clock
    and the batch (services/core/prefill_pacer.py). Queries sharing a boundary (runs of
    block_size positions) take one causal call over the keys before them, in position order, so
    no call scores a masked key. Rows past the cache's end (padding in a batch) come out zero;
    nothing reads them."""
    keys_codec, values_codec = cache.key_codec, cache.value_codec
    sinks = token_length(cache.sink_keys)
    aged_keys, aged_values, first_aged = cache.just_aged
    run_keys, run_values = decoded_run(
        keys_codec, values_codec, cache.compressed_keys, cache.compressed_values, dtype
    )  # positions sinks .. sinks + compressed_length

    def rotated_keys(runs: list[mx.array]) -> list[mx.array]:
        return [keys_codec.rotation.forward(k).astype(dtype) for k in runs]

    def rotated_values(runs: list[mx.array]) -> list[mx.array]:
        return [values_codec.rotation.forward(v).astype(dtype) for v in runs]

    sink_keys = rotated_keys([cache.sink_keys] if sinks else [])  # positions 0 .. sinks
    sink_values = rotated_values([cache.sink_values] if sinks else [])
    recent = bool(token_length(cache.recent_keys))  # exact runs: first_aged .. the cache's end
    exact_keys = _along_tokens(rotated_keys([aged_keys, cache.recent_keys] if recent else [aged_keys]))
    exact_values = _along_tokens(
        rotated_values([aged_values, cache.recent_values] if recent else [aged_values])
    )
    L = q.shape[2]
    real = max(0, min(L, cache.offset - start))
    cuts = compressed_boundaries(cache, start, L).tolist()
    outputs, a = [], 0
    while a < real:  # queries a..b-1 share a boundary: one causal call over positions 0..b-1
        b = a + 1
        while b < real and cuts[b] == cuts[a]:
            b += 1
        exact_part = slice(cuts[a] - first_aged, start + b - first_aged)
        keys = [run_keys[:, :, : cuts[a] - sinks], exact_keys[:, :, exact_part]]
        values = [run_values[:, :, : cuts[a] - sinks], exact_values[:, :, exact_part]]
        outputs.append(
            mx.fast.scaled_dot_product_attention(
                q[:, :, a:b],
                _along_tokens([*sink_keys, *keys]),
                _along_tokens([*sink_values, *values]),
                scale=scale,
                mask="causal" if b - a > 1 else None,
            )
        )
        a = b
    if real < L:  # padding rows of a batch: never read
        outputs.append(mx.zeros((*q.shape[:2], L - real, q.shape[3]), dtype=q.dtype))
    return _along_tokens(outputs)


def _along_tokens(arrays: list[mx.array]) -> mx.array:
    """[B, H, T, D] arrays joined along T (a lone one as it is)."""
    return mx.concatenate(arrays, axis=2) if len(arrays) > 1 else arrays[0]


def _exact_attention(queries: mx.array, cache: TurboQuantKVCache, scale: float) -> mx.array:
    """Nothing compressed yet (a context within the sinks and the window, most chats): the two
    exact runs hold every token in order, so this is the fp16 cache's own fused attention, with
    no rotation and no mask beyond the causal one. (Keys stored centred differ from the raw ones
    by one vector, which shifts each query's scores by one constant: the softmax ignores it.)"""
    runs = [
        (keys, values)
        for keys, values in ((cache.sink_keys, cache.sink_values), (cache.recent_keys, cache.recent_values))
        if token_length(keys)
    ]
    keys, values = _along_tokens([k for k, _ in runs]), _along_tokens([v for _, v in runs])
    return mx.fast.scaled_dot_product_attention(
        queries,
        keys.astype(queries.dtype),
        values.astype(queries.dtype),
        scale=scale,
        mask="causal" if queries.shape[2] > 1 else None,
    )
