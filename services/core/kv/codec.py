"""TurboQuant encode/decode for one cache tensor (keys or values) of one layer.

MSE stage (Zandieh et al. 2025, Algorithm 1): store |x| in float16, rotate x/|x| with
a randomized Hadamard transform, quantize each coordinate to the nearest Lloyd-Max
centroid for N(0, 1/P). QJL stage for keys (Algorithm 2): take the residual r of the
unit vector, store |r| in float16 and sign(S r) as one bit per coordinate, so that

    <q, k> ~= |k| (<Fq, c> + qjl_scale(P) |r| <S Fq, sign(S r)>)

is unbiased (F the rotation, c the centroids). Attention never leaves the rotated
domain: queries are rotated once (`rotate_queries`), keys are scored from their codes
(`key_scores`), values are summed as centroids (`decode_rotated`) and the sum is
rotated back once (`unrotate`).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from services.core.kv.codebook import codebook_for_dim
from services.core.kv.compressed import CompressedTokens
from services.core.kv.packing import lookup_decode, lookup_table, pack_indices, pack_plane, packed_bytes
from services.core.kv.rotation import RandomizedHadamard, qjl_scale, random_orthogonal

_TINY = 1e-12


class TurboQuantCodec:
    """Quantizes vectors of length `dim` to `bits` bits per coordinate (+1 QJL bit when
    `qjl`). Deterministic given `seed`; instances hold only constants and may be shared
    by any number of caches and threads."""

    def __init__(self, dim: int, bits: int, qjl: bool, seed: int):
        self.dim, self.bits, self.qjl = dim, bits, qjl
        self.rotation = RandomizedHadamard(dim, seed)
        self.padded = self.rotation.padded
        self.code_bytes = packed_bytes(bits, self.padded)  # one vector's packed codes (the kernels' layout)
        centroids, boundaries = codebook_for_dim(bits, self.padded)
        self.centroids = mx.array(centroids)
        self.boundaries = mx.array(boundaries)
        self.centroid_table = mx.array(lookup_table(bits, centroids))
        if qjl:
            s = random_orthogonal(self.padded, seed + 7919)
            self.qjl_matrix_t = mx.array(s.T.astype(np.float32))  # r @ S^T = (S r)^T
            self.qjl_matrix = mx.array(s.astype(np.float32))
            self.qjl_scale = qjl_scale(self.padded)
        self._qjl_matrix_as: dict = {}

    @property
    def qjl_scale(self) -> float:
        return self._qjl_scale

    @qjl_scale.setter
    def qjl_scale(self, value: float) -> None:
        # sign(S r) decodes to qjl_scale * +-1, so the constant costs nothing per step
        self._qjl_scale = value
        self.sign_table = mx.array(lookup_table(1, np.array([-1.0, 1.0]) * value))

    # ---- encode -------------------------------------------------------------------------

    def quantize_unit(self, unit: mx.array) -> mx.array:
        """Indices (uint8) of the nearest centroids of rotated unit vectors [..., P]."""
        return mx.sum(unit[..., None] > self.boundaries, axis=-1).astype(mx.uint8)

    def encode(self, x: mx.array) -> CompressedTokens:
        x = x.astype(mx.float32)
        norm = mx.linalg.norm(x, axis=-1)
        unit = self.rotation.forward(x / mx.maximum(norm, _TINY)[..., None])
        indices = self.quantize_unit(unit)
        codes = pack_indices(indices, self.bits)
        if not self.qjl:
            return CompressedTokens(norm.astype(mx.float16), codes)
        residual = unit - self.centroids[indices]
        projected = residual @ self.qjl_matrix_t
        signs = pack_plane((projected >= 0).astype(mx.uint8), 1)
        residual_norm = mx.linalg.norm(residual, axis=-1)
        return CompressedTokens(norm.astype(mx.float16), codes, residual_norm.astype(mx.float16), signs)

    # ---- decode / attention in the rotated domain ---------------------------------------

    def centroid_values(self, tokens: CompressedTokens) -> mx.array:
        """The MSE-stage unit vectors in the rotated domain, float32 [B, H, T, P]."""
        return lookup_decode(tokens.codes, self.bits, self.centroid_table)

    def scaled_signs(self, tokens: CompressedTokens) -> mx.array:
        """qjl_scale * sign(S r) of QJL keys, float32 [B, H, T, P]."""
        return lookup_decode(tokens.qjl_signs, 1, self.sign_table)

    def decode_rotated(self, tokens: CompressedTokens) -> mx.array:
        """|x| * centroids: the MSE reconstruction, still rotated, float32 [B, H, T, P]."""
        return self.centroid_values(tokens) * tokens.norm.astype(mx.float32)[..., None]

    def decode(self, tokens: CompressedTokens) -> mx.array:
        """The MSE reconstruction in the original domain (tests and diagnostics)."""
        return self.rotation.inverse(self.decode_rotated(tokens))

    def rotate_queries(self, queries: mx.array) -> mx.array:
        return self.rotation.forward(queries)

    def unrotate(self, rotated: mx.array) -> mx.array:
        return self.rotation.inverse(rotated)

    def estimated_keys(self, tokens: CompressedTokens, dtype=mx.float32) -> mx.array:
        """|k| (c + qjl_scale |r| S^T sign(S r)), [B, H, T, P]: the key whose plain dot
        product with a rotated query Fq is the unbiased estimate, since
        <S Fq, sign(S r)> = <Fq, S^T sign(S r)>. Folding the QJL term costs a T x P x P
        matmul but halves the width of the score matmul, a win whenever many queries
        score the same keys (prefill). Transient, one layer at a time."""
        keys = self.centroid_values(tokens)
        if self.qjl:
            residual = self.scaled_signs(tokens) @ self.qjl_matrix  # rows: sign^T S
            keys = keys + residual * tokens.residual_norm.astype(mx.float32)[..., None]
        return (keys * tokens.norm.astype(mx.float32)[..., None]).astype(dtype)

    def qjl_matrix_in(self, dtype) -> mx.array:
        """S in `dtype` (made once per dtype: a cast per prefill call would be one more op)."""
        matrix = self._qjl_matrix_as.get(dtype)
        if matrix is None:
            matrix = self.qjl_matrix.astype(dtype)
            mx.eval(matrix)  # a constant, never a lazy node shared between threads
            self._qjl_matrix_as[dtype] = matrix
        return matrix

    def key_scores(self, rotated_queries: mx.array, tokens: CompressedTokens) -> mx.array:
        """<q, k> estimates, [B, H, L, T], for rotated queries [B, H, L, P]."""
        scores = rotated_queries @ self.centroid_values(tokens).swapaxes(-1, -2)
        if self.qjl:
            projected_q = rotated_queries @ self.qjl_matrix_t  # (S Fq)^T
            qjl = projected_q @ self.scaled_signs(tokens).swapaxes(-1, -2)
            scores = scores + qjl * tokens.residual_norm.astype(mx.float32)[..., None, :]
        return scores * tokens.norm.astype(mx.float32)[..., None, :]
