"""Dispatch of the TurboQuant GPU kernels, shared by the Metal and the CUDA backend.

metal/turboquant.metal and metal/turboquant.cu implement the same sections with the same
inputs, outputs, template arguments and grids (a grid counts threads in both MLX
factories), so everything on the host side lives here once; a backend module only picks
its source file and its factory (mx.fast.metal_kernel or mx.fast.cuda_kernel) and says
when it may be used.
"""

from __future__ import annotations

from functools import cache, lru_cache
from pathlib import Path

import mlx.core as mx

from metal.sections import read_sections

# name: (input names, output names, ensure_row_contiguous). decode_partial reads the cache's
# whole buffers through their strides: copying the sliced views MLX would otherwise make
# contiguous costs a pass over the cache on every step.
KERNELS = {
    "pack": (
        ["x", "rotation", "boundaries", "centroids", "qjl_t"],
        ["norm", "codes", "residual_norm", "signs"],
        True,
    ),
    "scores": (
        ["queries", "projected", "codes", "norm", "residual_norm", "signs", "centroids", "qjl_scale"],
        ["scores"],
        True,
    ),
    "values": (["weights", "codes", "norm", "centroids"], ["out"], True),
    "decode_partial": (
        [
            "queries",
            "params",
            "lengths",
            "sink_k",
            "sink_v",
            "recent_k",
            "recent_v",
            "k_norm",
            "k_codes",
            "k_rnorm",
            "k_signs",
            "v_norm",
            "v_codes",
            "k_rotation",
            "qjl_t",
            "k_centroids",
            "v_centroids",
        ],
        ["part_m", "part_l", "part_acc"],
        False,
    ),
    "decode_combine": (["part_m", "part_l", "part_acc", "lengths", "v_rotation"], ["out"], True),
    "decode_run": (
        [
            "k_norm",
            "k_codes",
            "k_rnorm",
            "k_signs",
            "v_norm",
            "v_codes",
            "k_centroids",
            "v_centroids",
            "qjl_scale",
        ],
        ["keys", "k_sign", "values"],
        True,
    ),
}

ROWS = 8  # query rows one thread scores (or sums values for) per token it decodes
CHUNK = 256  # tokens one block of the values kernel sums
TOKENS_PER_BLOCK = 256  # tokens (and threads) of one decode_partial block
MAX_DECODE_QUERIES = 8  # decode_attention serves L <= 8, like the twin's decode path
RUN_THREADS = 256  # threads of one decode_run block (one per coordinate)


@lru_cache(maxsize=64)
@lru_cache(maxsize=64)
def _placeholder(shape: tuple[int, ...], dtype) -> mx.array:
    """A stand-in input for a run a call does not have (its length is 0: never read). Made
    once per shape: a fresh one per call would be one more op (a fill launch on a GPU) per layer."""
    return mx.zeros(shape, dtype)


@lru_cache(maxsize=256)
def _params(scale: float, qjl_scale: float) -> mx.array:
    return mx.array([scale, qjl_scale], mx.float32)


@lru_cache(maxsize=4096)
def _lengths(sinks: int, compressed: int, recent: int, start: int) -> mx.array:
    # every layer of a step has the same lengths: one small array per step, not per layer
    return mx.array([sinks, compressed, recent, start], mx.int32)


def _blocks(n: int) -> int:
    return -(-n // TOKENS_PER_BLOCK)


class KernelBackend:
    """The TurboQuant kernels of `source`, built with `factory` (mx.fast.metal_kernel or
    mx.fast.cuda_kernel; `shared_limit` is the threadgroup memory one block may use).

    Contracts, all the twin's numbers (services/core/kv/codec.py, decode_attention.py); a
    codec is a TurboQuantCodec (dim, padded, bits, code_bytes per packed vector, its tables):
      pack(codec, x): x [..., D] -> (norm, codes, residual_norm, signs) as codec.encode stores them
      key_scores(codec, rotated_queries [B, H, L, P], tokens) -> [B, H, L, T], as codec.key_scores
      weighted_values(codec, w [B, H, L, T], tokens) -> sum_t w_t |v_t| c(v_t), rotated, [B, H, L, P]
      decoded_run(key_codec, value_codec, keys, values, dtype) -> (estimated keys, rotated values),
        [B, H, T, P] of dtype, as codec.estimated_keys and codec.decode_rotated: a prefill's
        transient copy of the compressed run in one kernel (plus one matmul for QJL keys)
      decode_attention(queries [B, Hq, L, D], cache, scale, start) -> softmax(q k^T scale) v over
        everything a TurboQuantKVCache holds (query row i at position start + i), straight
        from the codes in two kernels, or None where the fused kernel does not fit (more
        than MAX_DECODE_QUERIES queries, no compressed run, or more query rows than
        threadgroup memory holds): the caller then composes key_scores and weighted_values.
    """

    def __init__(self, source: Path, factory, shared_limit: int):
        self.source, self.factory, self.shared_limit = source, factory, shared_limit

    def sections(self) -> dict[str, str]:
        return read_sections(self.source)

    @cache  # noqa: B019 - one backend object per process, kernels built once each
    def kernel(self, name: str):
        inputs, outputs, contiguous = KERNELS[name]
        parts = self.sections()
        return self.factory(
            name=f"turboquant_{name}",
            input_names=inputs,
            output_names=outputs,
            source=parts[name],
            header=parts["header"],
            ensure_row_contiguous=contiguous,
        )

    # ---- pack ---------------------------------------------------------------------------

    def pack(self, codec, x: mx.array):
        lead = x.shape[:-1]
        flat = x.reshape(-1, codec.dim).astype(mx.float32)
        n, p = flat.shape[0], codec.padded
        code_bytes = codec.code_bytes
        qjl_t = codec.qjl_matrix_t if codec.qjl else _placeholder((1,), mx.float32)
        norm, codes, residual_norm, signs = self.kernel("pack")(
            inputs=[flat, codec.rotation.matrix, codec.boundaries, codec.centroids, qjl_t],
            template=[
                ("P", p),
                ("D", codec.dim),
                ("BITS", codec.bits),
                ("QJL", int(codec.qjl)),
                ("CODE_BYTES", code_bytes),
            ],
            grid=(n * p, 1, 1),
            threadgroup=(p, 1, 1),
            output_shapes=[(n,), (n, code_bytes), (n,), (n, p // 8)],
            output_dtypes=[mx.float16, mx.uint8, mx.float16, mx.uint8],
        )
        return (
            norm.reshape(lead),
            codes.reshape(*lead, code_bytes),
            residual_norm.reshape(lead) if codec.qjl else None,
            signs.reshape(*lead, p // 8) if codec.qjl else None,
        )

    # ---- scores and values of a compressed run (any number of queries) -----------------

    def key_scores(self, codec, rotated_queries: mx.array, tokens) -> mx.array:
        B, H, L, p = rotated_queries.shape
        T, G = tokens.length, B * H
        q = rotated_queries.reshape(G, L, p).astype(mx.float32)
        projected = q @ codec.qjl_matrix_t if codec.qjl else q
        (scores,) = self.kernel("scores")(
            inputs=[
                q,
                projected,
                tokens.codes.reshape(G, T, -1),
                tokens.norm.reshape(G, T),
                tokens.residual_norm.reshape(G, T) if codec.qjl else _placeholder((1, 1), mx.float16),
                tokens.qjl_signs.reshape(G, T, -1) if codec.qjl else _placeholder((1,), mx.uint8),
                codec.centroids,
                mx.array([codec.qjl_scale if codec.qjl else 0.0], mx.float32),
            ],
            template=[
                ("P", p),
                ("L", L),
                ("ROWS", ROWS),
                ("BITS", codec.bits),
                ("QJL", int(codec.qjl)),
                ("CODE_BYTES", codec.code_bytes),
            ],
            grid=(T, -(-L // ROWS), G),
            threadgroup=(128, 1, 1),
            output_shapes=[(G, L, T)],
            output_dtypes=[mx.float32],
        )
        return scores.reshape(B, H, L, T)

    def weighted_values(self, codec, weights: mx.array, tokens) -> mx.array:
        B, H, L, T = weights.shape
        p, G = codec.padded, B * H
        chunks = max(1, -(-T // CHUNK))
        (partial,) = self.kernel("values")(
            inputs=[
                weights.reshape(G, L, T).astype(mx.float32),
                tokens.codes.reshape(G, T, -1),
                tokens.norm.reshape(G, T),
                codec.centroids,
            ],
            template=[
                ("P", p),
                ("L", L),
                ("ROWS", ROWS),
                ("CHUNK", CHUNK),
                ("BITS", codec.bits),
                ("CODE_BYTES", codec.code_bytes),
            ],
            grid=(p * chunks, -(-L // ROWS), G),
            threadgroup=(p, 1, 1),
            output_shapes=[(G, chunks, L, p)],
            output_dtypes=[mx.float32],
        )
        return partial.sum(axis=1).reshape(B, H, L, p)

    # ---- a compressed run decoded for one prefill call -----------------------------------

    def decoded_run(self, key_codec, value_codec, keys, values, dtype):
        B, H, T = keys.norm.shape
        p, G = key_codec.padded, B * H
        if value_codec.padded != p:
            return None
        qjl = key_codec.qjl
        grid = -(-T * p // RUN_THREADS) * RUN_THREADS  # whole blocks; the kernel skips the tail
        k_out, k_sign, v_out = self.kernel("decode_run")(
            inputs=[
                keys.norm.reshape(G, T),
                keys.codes.reshape(G, T, -1),
                keys.residual_norm.reshape(G, T) if qjl else _placeholder((1, 1), mx.float16),
                keys.qjl_signs.reshape(G, T, -1) if qjl else _placeholder((1,), mx.uint8),
                values.norm.reshape(G, T),
                values.codes.reshape(G, T, -1),
                key_codec.centroids,
                value_codec.centroids,
                _params(key_codec.qjl_scale if qjl else 0.0, 0.0),
            ],
            template=[
                ("P", p),
                ("KBITS", key_codec.bits),
                ("VBITS", value_codec.bits),
                ("QJL", int(qjl)),
                ("KCODE_BYTES", key_codec.code_bytes),
                ("VCODE_BYTES", value_codec.code_bytes),
                ("OT", dtype),
            ],
            grid=(grid, G, 1),
            threadgroup=(RUN_THREADS, 1, 1),
            output_shapes=[(G, T, p), (G, T, p) if qjl else (1,), (G, T, p)],
            output_dtypes=[dtype, dtype, dtype],
        )
        if qjl:  # |k| qjl_scale |r| sign(S r)^T S: the QJL term folded into the key, one matmul
            k_out = mx.addmm(k_out, k_sign, key_codec.qjl_matrix_in(dtype))
        return k_out.reshape(B, H, T, p), v_out.reshape(B, H, T, p)

    # ---- the whole decode step ----------------------------------------------------------

    def decode_attention(self, queries: mx.array, cache, scale: float, start: int) -> mx.array | None:
        B, n_q_heads, L, D = queries.shape
        key_buffer, value_buffer = cache.compressed_key_buffer, cache.compressed_value_buffer
        if key_buffer is None or L > MAX_DECODE_QUERIES:
            return None
        key_codec, value_codec = cache.key_codec, cache.value_codec
        p, n_kv_heads = key_codec.padded, key_buffer.arrays[0].shape[1]
        rows = (n_q_heads // n_kv_heads) * L
        shared = 4 * rows * (2 * p + 2 * TOKENS_PER_BLOCK)  # decode_partial's four float arrays
        fits = value_codec.padded == p <= TOKENS_PER_BLOCK and key_codec.dim == value_codec.dim == D
        if not fits or shared > self.shared_limit or n_q_heads % n_kv_heads:
            return None
        n_sinks = 0 if cache.sink_keys is None else cache.sink_keys.shape[2]
        recent = (
            cache.recent_buffer if cache.recent_buffer is not None and cache.recent_buffer.length else None
        )
        exact = ([cache.sink_keys] if n_sinks else []) + (list(recent.arrays) if recent else [])
        dtype = exact[0].dtype if exact else queries.dtype
        if any(a.dtype != dtype for a in exact):
            return None
        none = _placeholder((1, 1, 1, D), dtype)
        sink_k, sink_v = (cache.sink_keys, cache.sink_values) if n_sinks else (none, none)
        recent_k, recent_v = recent.arrays if recent else (none, none)
        n_recent = recent.length if recent else 0
        if key_codec.qjl:
            k_norm, k_codes, k_rnorm, k_signs = key_buffer.arrays
            qjl_t = key_codec.qjl_matrix_t
        else:
            k_norm, k_codes = key_buffer.arrays
            k_rnorm, k_signs = _placeholder((1, 1, 1), mx.float16), _placeholder((1, 1, 1, 1), mx.uint8)
            qjl_t = _placeholder((1,), mx.float32)
        v_norm, v_codes = value_buffer.arrays
        lengths = _lengths(n_sinks, key_buffer.length, n_recent, start)
        n_blocks = _blocks(n_sinks + n_recent) + _blocks(key_buffer.length)
        G = B * n_kv_heads
        part_m, part_l, part_acc = self.kernel("decode_partial")(
            inputs=[
                queries,
                _params(float(scale), key_codec.qjl_scale if key_codec.qjl else 0.0),
                lengths,
                sink_k,
                sink_v,
                recent_k,
                recent_v,
                k_norm,
                k_codes,
                k_rnorm,
                k_signs,
                v_norm,
                v_codes,
                key_codec.rotation.matrix,
                qjl_t,
                key_codec.centroids,
                value_codec.centroids,
            ],
            template=[
                ("P", p),
                ("D", D),
                ("R", rows),
                ("L", L),
                ("TB", TOKENS_PER_BLOCK),
                ("KBITS", key_codec.bits),
                ("VBITS", value_codec.bits),
                ("QJL", int(key_codec.qjl)),
                ("QT", queries.dtype),
                ("KT", dtype),
            ],
            grid=(n_blocks * TOKENS_PER_BLOCK, G, 1),
            threadgroup=(TOKENS_PER_BLOCK, 1, 1),
            output_shapes=[(G, n_blocks, rows), (G, n_blocks, rows), (G, n_blocks, rows, p)],
            output_dtypes=[mx.float32, mx.float32, mx.float32],
        )
        (out,) = self.kernel("decode_combine")(
            inputs=[part_m, part_l, part_acc, lengths, value_codec.rotation.matrix],
            template=[("P", p), ("D", D), ("R", rows), ("TB", TOKENS_PER_BLOCK), ("OT", queries.dtype)],
            grid=(p, rows, G),
            threadgroup=(p, 1, 1),
            output_shapes=[(G, rows, D)],
            output_dtypes=[queries.dtype],
        )
        return out.reshape(B, n_q_heads, L, D)
