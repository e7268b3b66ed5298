"""Image positions that attend to each other both ways (Gemma's "vision" attention): which pairs of
a prefill window's positions open up, where a window may end, and how a layer's causal mask opens."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache

from services.core.vision.image_blocks import (
    ImagesAttendBothWays,
    images_attend_both_ways,
    same_image,
    whole_images_stop,
)
from services.core.vision.prompt_images import PromptImage


def image(tokens: int, offsets=()) -> PromptImage:
    return PromptImage("a" * 64, np.zeros(1), None, tokens, (9,) * tokens, offsets=offsets)


def test_only_positions_of_one_image_open_to_each_other():
    spans = [(2, image(3)), (6, image(2))]  # positions 2-4 and 6-7 of a 9-position window
    opened = np.array(same_image(spans, 0, 9))
    assert opened[2:5, 2:5].all() and opened[6:8, 6:8].all()
    assert opened.sum() == 9 + 4  # nothing between the images, nothing across them, no text
    assert np.array(same_image(spans, 3, 7)).sum() == 4 + 1  # a window sees its own part only


def test_a_window_ends_past_any_image_it_would_cut():
    spans = [(2, image(3)), (6, image(2))]
    assert whole_images_stop(spans, 3, 20) == 5
    assert whole_images_stop(spans, 7, 20) == 8
    assert whole_images_stop(spans, 5, 20) == 5 and whole_images_stop(spans, 6, 20) == 6  # between
    assert whole_images_stop(spans, 3, 4) == 4  # never past the prompt's prefill end


def test_a_causal_mask_over_held_keys_opens_only_among_the_window():
    """Two keys held before a 4-position window whose last three are one image: the held keys stay
    as causal made them, the image's positions see each other."""

    class Layer:
        layer_type = "full_attention"

    class Owner:
        layers = [Layer()]
        window_size = None

        def _make_masks(self, h, cache):
            return ["causal"]

    cache = KVCache()
    cache.update_and_fetch(mx.zeros((1, 1, 2, 4)), mx.zeros((1, 1, 2, 4)))
    owner = Owner()
    with ImagesAttendBothWays(owner, same_image([(3, image(3))], 2, 6)):
        (mask,) = owner._make_masks(mx.zeros((1, 4, 8)), [cache])
    want = np.array(create_causal_mask(4, offset=2))
    want[1:, 3:] = True
    assert np.array_equal(np.array(mask), want)
    assert owner._make_masks(None, None) == ["causal"]  # the model's own again


def test_which_configs_open_image_blocks():
    assert images_attend_both_ways({"text_config": {"use_bidirectional_attention": "vision"}})
    assert not images_attend_both_ways({"text_config": {"use_bidirectional_attention": None}})
    assert not images_attend_both_ways({"model_type": "qwen3_vl_moe"})


def test_an_additive_mask_is_refused_rather_than_opened_wrong():
    class Owner:
        layers = [object()]

        def _make_masks(self, h, cache):
            return [mx.zeros((2, 2))]

    with (
        pytest.raises(ValueError, match="additive"),
        ImagesAttendBothWays(Owner(), same_image([], 0, 2)) as opened,
    ):
        opened._masks(mx.zeros((1, 2, 4)), [None])
