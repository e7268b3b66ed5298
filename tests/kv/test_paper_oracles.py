"""TurboQuant against the paper's own figures (Zandieh et al. 2025, arXiv 2504.19874)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from services.core.kv.codebook import gaussian_lloyd_max
from services.core.kv.codec import TurboQuantCodec
from services.core.kv.rotation import qjl_scale

D = 128
N = 10_000
LLOYD_MAX = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.0095}


def unit_vectors(n: int, d: int, seed: int) -> mx.array:
    x = np.random.default_rng(seed).standard_normal((n, d))
    return mx.array((x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32))


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_gaussian_codebook_matches_lloyd_max_figures(bits):
    _, mse = gaussian_lloyd_max(bits)
    assert mse == pytest.approx(LLOYD_MAX[bits], rel=0.01)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_mse_distortion_on_random_unit_vectors_is_within_the_papers_bounds(bits):
    x = unit_vectors(N, D, seed=bits)[None, None]
    codec = TurboQuantCodec(D, bits, qjl=False, seed=11)
    distortion = mx.mean(mx.sum((x - codec.decode(codec.encode(x))) ** 2, axis=-1)).item()
    assert 4.0**-bits <= distortion <= math.sqrt(3) * math.pi / 2 * 4.0**-bits
    assert distortion == pytest.approx(LLOYD_MAX[bits], rel=0.10)


def inner_product_errors(bits: int, scale: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(errors of the QJL estimator, errors of the MSE-only estimator) over N pairs whose
    true inner product is large (~0.7), where a multiplicative bias would show."""
    keys = unit_vectors(N, D, seed=100 + bits)
    noise = unit_vectors(N, D, seed=200 + bits)
    queries = keys + noise
    queries = queries / mx.linalg.norm(queries, axis=-1, keepdims=True)
    codec = TurboQuantCodec(D, bits, qjl=True, seed=5)
    if scale is not None:
        codec.qjl_scale = scale
    tokens = codec.encode(keys[:, None, None, :])  # one key per "head" so pairs stay aligned
    rotated = codec.rotate_queries(queries[:, None, None, :])
    estimate = codec.key_scores(rotated, tokens)[:, 0, 0, 0]
    mse_only = (
        mx.sum(rotated[:, 0, 0] * codec.centroid_values(tokens)[:, 0, 0], axis=-1) * tokens.norm[:, 0, 0]
    )
    truth = mx.sum(keys * queries, axis=-1)
    return np.array(estimate - truth), np.array(mse_only.astype(mx.float32) - truth)


@pytest.mark.parametrize("bits", [2, 3])
def test_qjl_inner_product_estimator_is_unbiased_with_variance_within_d_prod(bits):
    errors, mse_errors = inner_product_errors(bits)
    standard_error = errors.std(ddof=1) / math.sqrt(N)
    assert abs(errors.mean()) < 4 * standard_error  # statistically indistinguishable from 0
    # The MSE stage alone is biased (it shrinks inner products): the test has the power to see bias.
    assert abs(mse_errors.mean()) > 10 * mse_errors.std(ddof=1) / math.sqrt(N)
    total_bits = bits + 1  # D_prod bound of TurboQuant_prod at b bits, |y| = 1 (Theorem 2)
    assert errors.var() <= math.sqrt(3) * math.pi**2 / D * 4.0**-total_bits


def test_gaussian_scale_on_an_orthogonal_s_is_biased():
    """sqrt(pi/2)/d (right for Gaussian S, wrong for orthogonal S) is ~11x too small at d=128."""
    errors, _ = inner_product_errors(3, scale=math.sqrt(math.pi / 2) / D)
    assert abs(errors.mean()) > 10 * errors.std(ddof=1) / math.sqrt(N)
    assert qjl_scale(D) / (math.sqrt(math.pi / 2) / D) == pytest.approx(math.sqrt(D), rel=0.01)
    assert qjl_scale(D) == pytest.approx(math.sqrt(math.pi / 2) / math.sqrt(D), rel=0.005)
