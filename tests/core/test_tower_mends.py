"""Vision towers mended where mlx-vlm's build far more graph than their math needs: the same numbers."""

from __future__ import annotations

import mlx.core as mx
import pytest

from services.core.vision.tower_mends import mend_tower, patches

pytest.importorskip("mlx_vlm")  # installed by the README's test command (requirements-vision.txt)


class PatchConfig:
    patch_size = 14
    num_channels = 3
    hidden_size = 8


@pytest.mark.parametrize("shape", [(1, 3, 56, 56), (2, 3, 42, 70), (1, 3, 60, 45)])
def test_patches_by_reshape_equal_llama4s_unfold(shape):
    from mlx_vlm.models.llama4.vision import Llama4UnfoldConvolution

    module = Llama4UnfoldConvolution(PatchConfig())
    images = mx.random.normal(shape, key=mx.random.key(sum(shape)))
    expected = module.unfold(images)
    assert patches(images, (14, 14)).shape == expected.shape
    assert mx.array_equal(patches(images, (14, 14)), expected).item()
    mend_tower(module)
    assert (
        "unfold" in vars(module)
        and mx.array_equal(module(images), module.linear(expected.swapaxes(1, 2))).item()
    )


def test_an_overlapping_unfold_is_left_as_it_is():
    from mlx_vlm.models.llama4.vision import Llama4UnfoldConvolution

    module = Llama4UnfoldConvolution(PatchConfig())
    module.stride = 7
    mend_tower(module)
    assert "unfold" not in vars(module)
