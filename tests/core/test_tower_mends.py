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


def test_deepseek_vl_v2s_crops_are_padded_with_zeros_to_one_entry_per_tile():
    """Its merge reads one entry per tile and stops at a zero one; unpadded, it reads past the end."""
    import json

    from services.common.vlm_language_models import build_vision_model
    from services.core.vision.tower_mends import padded_crops
    from services.tools.tiny_vlm import FAMILIES

    crops = mx.array([[[2, 1]]], dtype=mx.int32)
    padded = padded_crops(crops, 3)
    assert padded.tolist() == [[[2, 1], [0, 0], [0, 0]]] and padded.dtype == mx.int32
    assert padded_crops(padded, 2) is padded
    model = build_vision_model(json.loads(json.dumps(FAMILIES["deepseek_vl_v2"])))
    mend_tower(model)
    assert "get_input_embeddings" in vars(model)
