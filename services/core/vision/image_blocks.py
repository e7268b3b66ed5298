"""Image positions that attend to each other both ways, as Gemma's language models have them
(`use_bidirectional_attention: "vision"`): every position of an image sees the whole image, the
text around it stays causal.

On a prefill window the overlay can only reach keys the window itself computes, so a window must
hold each image it touches whole (`whole_images_stop`); the causal part of each layer's mask, with
its sliding window and the keys its cache already holds, stays the model's own.
"""

from __future__ import annotations

import mlx.core as mx
from mlx import nn
from mlx_lm.models.base import create_attention_mask

from services.common.model_shape import text_config


def images_attend_both_ways(config: dict) -> bool:
    return text_config(config).get("use_bidirectional_attention") == "vision"


def whole_images_stop(spans: list[tuple[int, object]], stop: int, end: int) -> int:
    """`stop` moved past the end of an image it would cut (at most to `end`)."""
    for first, image in spans:
        if first < stop < first + image.span:
            return min(first + image.span, end)
    return stop


def same_image(spans: list[tuple[int, object]], start: int, end: int) -> mx.array:
    """[L, L] for the window's positions: whether query and key are positions of one image."""
    block = [-1] * (end - start)
    for index, (first, image) in enumerate(spans):
        for offset in image.layout:
            if start <= first + offset < end:
                block[first + offset - start] = index
    ids = mx.array(block)
    return (ids[:, None] >= 0) & (ids[:, None] == ids[None, :])


class ImagesAttendBothWays:
    """For one call of a language model that makes its masks in `_make_masks(h, cache)` (Gemma's
    in mlx-lm), each layer's mask as an array with the window's image blocks opened both ways."""

    def __init__(self, owner: nn.Module, overlay: mx.array):
        self._owner, self._overlay = owner, overlay
        self._make_masks = owner._make_masks

    def __enter__(self):
        self._owner._make_masks = self._masks
        return self

    def __exit__(self, *_):
        del self._owner._make_masks  # the class's method again

    def _masks(self, h: mx.array, cache: list) -> list:
        owner, made = self._owner, {}
        masks = []
        for layer, layer_cache, mask in zip(owner.layers, cache, self._make_masks(h, cache), strict=True):
            kind = getattr(layer, "layer_type", None)
            if kind not in made:
                causal = mask
                if not isinstance(causal, mx.array):  # "causal" or None: the same as an array
                    window = owner.window_size if kind == "sliding_attention" else None
                    causal = create_attention_mask(h, layer_cache, window_size=window, return_array=True)
                made[kind] = self._open(causal, h.shape[1])
            masks.append(made[kind])
        return masks

    def _open(self, causal: mx.array | None, length: int) -> mx.array | None:
        if causal is None:  # one position: nothing to open
            return None
        if causal.dtype != mx.bool_:
            raise ValueError("an additive attention mask: image blocks open only in boolean ones")
        new_keys = causal[..., -length:] | self._overlay
        return mx.concatenate([causal[..., :-length], new_keys], axis=-1)
