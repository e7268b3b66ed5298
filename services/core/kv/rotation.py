"""The two fixed random linear maps of TurboQuant, seeded so every process agrees.

* `RandomizedHadamard`: x -> H diag(s) x / sqrt(P) with random signs s, P the head dim
  rounded up to a power of two (shorter vectors are zero-padded). Orthogonal, so inner
  products and norms are preserved, and after it every coordinate of a unit vector is
  ~N(0, 1/P) whatever the input: the codebook needs no calibration.
* `random_orthogonal`: a Haar-random orthogonal matrix S for the QJL stage.

Both are stored as dense P x P float32 matrices: at P <= 256 one matmul is faster in MLX
than a butterfly of log2(P) small ops, and the Metal kernels read the same matrices.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np


def next_power_of_two(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(n)))


def hadamard(size: int) -> np.ndarray:
    """The Sylvester Hadamard matrix of order `size` (a power of two), entries +-1."""
    if size & (size - 1):
        raise ValueError(f"Hadamard order must be a power of two, got {size}")
    h = np.ones((1, 1), dtype=np.float64)
    while h.shape[0] < size:
        h = np.block([[h, h], [h, -h]])
    return h


class RandomizedHadamard:
    """Rotation of head vectors of length `dim` into R^P, P = next power of two.

    `forward(x)` pads x with zeros to P and returns x @ M with M = diag(s) H / sqrt(P)
    (so forward(x) = H diag(s) x / sqrt(P) as a column vector); `inverse(y)` returns
    y @ M^T cut back to `dim`. forward preserves inner products: <Fq, Fk> = <q, k>."""

    def __init__(self, dim: int, seed: int):
        self.dim = dim
        self.padded = next_power_of_two(dim)
        signs = np.random.default_rng(seed).choice([-1.0, 1.0], size=self.padded)
        matrix = signs[:, None] * hadamard(self.padded) / math.sqrt(self.padded)
        self.matrix = mx.array(matrix.astype(np.float32))
        self.matrix_t = mx.array(matrix.T.astype(np.float32))

    def pad(self, x: mx.array) -> mx.array:
        if self.padded == self.dim:
            return x
        widths = [(0, 0)] * (x.ndim - 1) + [(0, self.padded - self.dim)]
        return mx.pad(x, widths)

    def forward(self, x: mx.array) -> mx.array:
        return self.pad(x.astype(mx.float32)) @ self.matrix

    def inverse(self, y: mx.array) -> mx.array:
        out = y @ self.matrix_t
        return out if self.padded == self.dim else out[..., : self.dim]


def random_orthogonal(size: int, seed: int) -> np.ndarray:
    """A Haar-distributed orthogonal matrix (QR of a Gaussian with the sign fix)."""
    gaussian = np.random.default_rng(seed).standard_normal((size, size))
    q, r = np.linalg.qr(gaussian)
    return q * np.sign(np.diag(r))[None, :]


def qjl_scale(size: int) -> float:
    """The constant that makes sum_i <s_i, q> sign(<s_i, r>) an unbiased estimate of
    <q, r> / |r| when the s_i are the rows of a Haar-orthogonal matrix.

    Each row is uniform on the unit sphere, where E|s_1| = Gamma(P/2) / (sqrt(pi)
    Gamma((P+1)/2)), so the scale is 1 / (P E|s_1|) -> sqrt(pi/2) / sqrt(P) for large P
    (within 0.2% at P = 128). The Gaussian-S form sqrt(pi/2) / P is sqrt(P) times too
    small here, about 11x at P = 128."""
    mean_abs = math.exp(math.lgamma(size / 2) - math.lgamma((size + 1) / 2)) / math.sqrt(math.pi)
    return 1.0 / (size * mean_abs)
