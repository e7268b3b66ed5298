"""Decode steps without an attention mask, for batches whose rows carry no left padding.

mlx-lm's `BatchKVCache` left-pads its rows to one length and builds a mask on every layer of
every step to hide the padding. A one-token step of a batch with no padding (one sequence, or
rows that `filter()` has aligned) needs no mask: every row sees every key before it. There the
mask costs twice: its own ops per layer, and on MLX's CUDA backend the fused one-query attention
kernel takes no array mask, so a masked decode step falls back to the unfused attention
(docs/benchmarks.md, "Decode attention mask").

`skip_decode_mask_if_unpadded(caches)` is called before each decode forward; it reads the
padding (evaluated already in the steady state: only a batch change makes it lazy) and tells
the batch's caches whether their one-token mask may be left out.
"""

from __future__ import annotations

import types

from mlx_lm.models.cache import BatchKVCache

from services.common.mlx_lm_adapter import right_padding


def _mask_unless_unpadded(cache: BatchKVCache, N: int, return_array: bool = False, **kwargs):
    if N == 1 and cache.decode_unpadded and kwargs.get("window_size") is None:
        return None
    return BatchKVCache.make_mask(cache, N, return_array=return_array, **kwargs)


def skip_decode_mask_if_unpadded(caches: list) -> bool:
    """Mark the batch's `BatchKVCache`s (every layer shares one padding) with whether their rows
    are unpadded; their one-token steps then run without a mask. Returns that answer."""
    batch = [c for c in caches if type(c) is BatchKVCache]
    if not batch:
        return False
    first = batch[0]
    unpadded = right_padding(first) is None and max(first.left_padding.tolist(), default=0) == 0
    for cache in batch:
        if "make_mask" not in vars(cache):
            cache.make_mask = types.MethodType(_mask_unless_unpadded, cache)
        cache.decode_unpadded = unpadded
    return unpadded
