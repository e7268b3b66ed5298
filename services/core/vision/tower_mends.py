"""Where mlx-vlm's vision towers build far more graph than their math needs, mended after core builds
them (the numbers stay the same).

Llama 4's patch embedding (`Llama4UnfoldConvolution`) cuts the image into patches with one slice per
pixel of every patch: a 336-pixel tile of 14-pixel patches makes 112,896 slices, each its own kernel
on a GPU. Its stride is its kernel, so the same patches are one reshape and transpose of the image.
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


# module class name -> its mend
_MENDS = {"Llama4UnfoldConvolution": _unfold_by_reshape}


def mend_tower(model: nn.Module) -> None:
    """`model` (mlx-vlm's, as core builds it), mended in place where listed above."""
    for _, module in model.named_modules():
        mend = _MENDS.get(type(module).__name__)
        if mend is not None:
            mend(module)
