"""Metal kernels against the pure-MLX twin. Needs an Apple GPU: elsewhere mx.fast.metal_kernel
cannot run at all, so the comparison is skipped (the twin itself is tested everywhere)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from metal import kernels

needs_metal = pytest.mark.skipif(not mx.metal.is_available(), reason="Metal kernels need an Apple GPU")


def test_kernel_sources_have_every_section():
    sections = kernels._sections()
    assert {"header", "pack", "scores", "values"} <= set(sections)
    assert "tq_index" in sections["header"]


def test_kernels_are_never_used_without_metal():
    assert kernels.kernels_available() == (mx.metal.is_available() and kernels.kernels_match_twin())


@needs_metal
def test_kernels_match_the_twin():
    assert kernels.kernels_match_twin(seed=0)
    assert kernels.kernels_match_twin(seed=1)
