"""Lloyd-Max scalar codebooks for the coordinates of a randomly rotated unit vector.

After a random rotation, each coordinate of a unit vector in R^d is distributed
(almost exactly, for d >= 64) as N(0, 1/d), independently of the data. So one
optimal scalar quantizer per bit width, computed once for N(0, 1) and scaled by
1/sqrt(d), serves every layer and head with no calibration (TurboQuant, Zandieh et
al. 2025, section 3.1). The Lloyd-Max iteration (centroid <-> midpoint) converges to
the paper's figures: MSE 0.3634, 0.1175, 0.03454, 0.0095 for 1-4 bits.
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np

SUPPORTED_BITS = (1, 2, 3, 4)


def _pdf(x: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _cdf(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


@cache
def gaussian_lloyd_max(bits: int, iterations: int = 2000) -> tuple[np.ndarray, float]:
    """Centroids (ascending, float64) of the 2**bits-level Lloyd-Max quantizer for
    N(0, 1), and its mean squared error."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"codebook bits must be one of {SUPPORTED_BITS}, got {bits}")
    levels = 2**bits
    # Start from equiprobable cells: close to optimal, so the iteration converges fast.
    centroids = np.array([_quantile((i + 0.5) / levels) for i in range(levels)])
    for _ in range(iterations):
        edges = np.concatenate([[-np.inf], (centroids[1:] + centroids[:-1]) / 2, [np.inf]])
        mass = _cdf(edges[1:]) - _cdf(edges[:-1])
        # E[x | a < x < b] = (pdf(a) - pdf(b)) / (cdf(b) - cdf(a)) for the standard normal
        new = (_pdf(edges[:-1]) - _pdf(edges[1:])) / mass
        if np.max(np.abs(new - centroids)) < 1e-12:
            centroids = new
            break
        centroids = new
    edges = np.concatenate([[-np.inf], (centroids[1:] + centroids[:-1]) / 2, [np.inf]])
    return centroids, _mse(centroids, edges)


def _mse(centroids: np.ndarray, edges: np.ndarray) -> float:
    # E[(x - c)^2] over each cell, in closed form for the standard normal.
    a, b = edges[:-1], edges[1:]
    fa, fb = _pdf(a), _pdf(b)
    with np.errstate(invalid="ignore"):  # inf * 0 at the outer edges, replaced by 0
        af = np.where(np.isinf(a), 0.0, a * fa)
        bf = np.where(np.isinf(b), 0.0, b * fb)
    mass = _cdf(b) - _cdf(a)
    second = mass + af - bf  # E[x^2; cell]
    first = fa - fb  # E[x; cell]
    return float(np.sum(second - 2 * centroids * first + centroids**2 * mass))


def _quantile(p: float) -> float:
    lo, hi = -10.0, 10.0
    for _ in range(200):  # bisection: exact enough and needs no scipy
        mid = (lo + hi) / 2
        if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def codebook_for_dim(bits: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(centroids, decision boundaries) as float32 for coordinates ~ N(0, 1/dim).

    Boundaries are the 2**bits - 1 midpoints: a coordinate's index is the number of
    boundaries below it."""
    centroids, _ = gaussian_lloyd_max(bits)
    scaled = centroids / math.sqrt(dim)
    boundaries = (scaled[1:] + scaled[:-1]) / 2
    return scaled.astype(np.float32), boundaries.astype(np.float32)
