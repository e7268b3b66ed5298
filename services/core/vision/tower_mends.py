"""Where mlx-vlm's vision towers build far more graph than their math needs, mended after core builds
them (the numbers stay the same).

Llama 4's patch embedding (`Llama4UnfoldConvolution`) cuts the image into patches with one slice per
pixel of every patch: a 336-pixel tile of 14-pixel patches makes 112,896 slices, each its own kernel
on a GPU. Its stride is its kernel, so the same patches are one reshape and transpose of the image.

DeepSeek-VL2's merge walks `images_spatial_crop` for as many images as `pixel_values` has tiles, and
stops at a zero entry; with fewer images than tiles it reads past the array's end (MLX does not check
indices), and whatever lies there can drop or garble the image's features. Its batch collation pads
the array with zeros, so does the mend, to as many entries as there are tiles.
"""

from __future__ import annotations

import mlx.core as mx
from mlx import nn


def patches(images: mx.array, kernel: tuple[int, int]) -> mx.array:
    """Non-overlapping `kernel` patches of `images` (B, C, H, W) as (B, C * kh * kw, patches),
    ordered as torch's `unfold` with stride equal to the kernel orders them."""
    batch, channels, height, width = images.shape
    kh, kw = kernel
    rows, cols = height // kh, width // kw
    blocks = images[:, :, : rows * kh, : cols * kw].reshape(batch, channels, rows, kh, cols, kw)
    return blocks.transpose(0, 1, 3, 5, 2, 4).reshape(batch, channels * kh * kw, rows * cols)


def _pair(value) -> tuple[int, int]:
    return tuple(value) if isinstance(value, list | tuple) else (value, value)


def _unfold_by_reshape(module: nn.Module) -> None:
    kernel = _pair(module.kernel_size)
    if _pair(module.stride) == kernel:
        module.unfold = lambda images: patches(images, kernel)


def _spatial_crops_padded(model: nn.Module) -> None:
    merge = model.get_input_embeddings

    def get_input_embeddings(input_ids=None, pixel_values=None, images_spatial_crop=None, *args, **kwargs):
        if pixel_values is not None and images_spatial_crop is not None:
            images_spatial_crop = padded_crops(images_spatial_crop, pixel_values.shape[1])
        return merge(input_ids, pixel_values, images_spatial_crop, *args, **kwargs)

    model.get_input_embeddings = get_input_embeddings


def padded_crops(crops: mx.array, entries: int) -> mx.array:
    """DeepSeek-VL2's `images_spatial_crop` (batch, images, 2) padded with zeros to `entries` images."""
    missing = entries - crops.shape[1]
    if missing <= 0:
        return crops
    return mx.concatenate([crops, mx.zeros((crops.shape[0], missing, 2), dtype=crops.dtype)], axis=1)


# (mlx-vlm family, module class name) -> its mend
_MENDS = {
    ("llama4", "Llama4UnfoldConvolution"): _unfold_by_reshape,
    ("deepseek_vl_v2", "Model"): _spatial_crops_padded,
}


def mend_tower(model: nn.Module) -> None:
    """`model` (mlx-vlm's, as core builds it), mended in place where listed above."""
    for _, module in model.named_modules():
        kind = type(module)
        family = kind.__module__.split(".")[2] if kind.__module__.startswith("mlx_vlm.models.") else ""
        mend = _MENDS.get((family, kind.__name__))
        if mend is not None:
            mend(module)
