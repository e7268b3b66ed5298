"""Recurrent layers' rows that drop rejected drafts: the linear-attention (gated delta) layers of
hybrid models such as Qwen3-Next and Qwen3.5.

Such a layer keeps a convolution window and a recurrent state per row instead of keys and values,
and a verify forward folds every drafted position into them, rejected ones included; nothing can
be cut back out. So, while a verify forward runs, each of these layers keeps its input and the
state it started from. Once acceptance is known, the layer runs again from that state over the
same input with each row's positions past its kept ones masked out: mlx-lm's own right-padded path
(`ArraysCache.lengths` and the mask) then leaves every row's window and state at its last kept
position, exactly as if only those positions had been fed. The replay reuses the armed forward's
input projections (`in_proj_*`, the same input gives the same output), so it costs the convolution
and the recurrence over the drafted positions once more, and no expert call.
"""

from __future__ import annotations

import mlx.core as mx
from mlx import nn
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

# mlx-lm's gated delta layers, which take a right-padding mask and `ArraysCache.lengths`
MIXERS = ("GatedDeltaNet", "Qwen3NextGatedDeltaNet")


class KeptProjection(nn.Module):
    """One of a mixer's input projections over one armed forward and its replay: computes its output
    once and gives the same back after, since the replay feeds the same input."""

    def __init__(self, linear: nn.Module):
        super().__init__()
        self.linear = linear
        self._kept: mx.array | None = None

    def __call__(self, x: mx.array) -> mx.array:
        if self._kept is None:
            self._kept = self.linear(x)
        return self._kept


class ReplayableMixer(nn.Module):
    """A linear-attention layer that keeps, for the forward it is armed for, its input, its input
    projections and the cache state that forward started from. Other forwards run the layer as it
    is: the kept projections stand in for its own only during the armed forward and the replay."""

    def __init__(self, mixer: nn.Module):
        super().__init__()
        self.mixer = mixer
        self._inputs = tuple(
            n for n, c in mixer.children().items() if n.startswith("in_proj") and isinstance(c, nn.Module)
        )
        self._kept: tuple = ()  # (name, KeptProjection) of the armed forward; a tuple stays out of the tree
        self._armed: ArraysCache | None = None  # the batch cache whose forward to keep
        self._taken: tuple[mx.array, object, object] | None = None

    def forget_projections(self) -> None:
        """Let the replay compute the input projections again (what reusing them saves)."""
        self._kept = ()

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache=None) -> mx.array:
        if cache is None or cache is not self._armed:
            return self.mixer(x, mask, cache)
        self._taken = (x, cache[0], cache[1])
        self._kept = tuple((name, KeptProjection(getattr(self.mixer, name))) for name in self._inputs)
        return self._with_kept(x, mask, cache)

    def _with_kept(self, x: mx.array, mask: mx.array | None, cache) -> mx.array:
        own = [(name, getattr(self.mixer, name)) for name, _ in self._kept]
        for name, projection in self._kept:
            setattr(self.mixer, name, projection)
        try:
            return self.mixer(x, mask, cache)
        finally:
            for name, linear in own:
                setattr(self.mixer, name, linear)

    def arm(self, cache: ArraysCache) -> None:
        self._armed, self._taken = cache, None

    def settle(self, cache: ArraysCache, drop: list[int]) -> None:
        """Leave row i of `cache` as if its armed forward had not fed its last drop[i] positions."""
        taken, self._armed, self._taken = self._taken, None, None
        if taken is not None and any(drop):
            x, window, state = taken
            width = x.shape[1]
            lengths, padding = cache.lengths, cache.left_padding
            cache[0], cache[1] = window, state
            kept = width - mx.array(drop)
            cache.lengths = kept
            self._with_kept(x, mx.arange(width)[None] < kept[:, None], cache)
            cache.lengths, cache.left_padding = lengths, padding
        self._kept = ()


class RecurrentRows:
    """The served model's recurrent layers, made replayable: `arm(caches)` before a verify
    forward, `settle(caches, drop)` once each row's rejected positions are known."""

    def __init__(self, mixers: dict[int, ReplayableMixer]):
        self.mixers = mixers  # layer index (= its cache's index) -> its mixer

    def arm(self, caches: list) -> None:
        for index, mixer in self.mixers.items():
            mixer.arm(caches[index])

    def settle(self, caches: list, drop: list[int]) -> None:
        for index, mixer in self.mixers.items():
            mixer.settle(caches[index], drop)


def recurrent_rows(model) -> RecurrentRows | None:
    """Make the model's recurrent layers replayable (None where it has none). Refused, naming
    the model and the cache, where a layer keeps state that cannot drop rejected tokens."""
    caches = make_prompt_cache(model)
    layers = getattr(model, "layers", None)
    if all(type(c) is KVCache for c in caches):
        return None
    model_type = getattr(getattr(model, "args", None), "model_type", type(model).__module__)
    mixers: dict[int, ReplayableMixer] = {}
    for index, cache in enumerate(caches):
        if type(cache) is KVCache:
            continue
        layer = layers[index] if layers is not None and len(layers) == len(caches) else None
        mixer = getattr(layer, "linear_attn", None)
        replayable = isinstance(mixer, ReplayableMixer) or type(mixer).__name__ in MIXERS
        if type(cache) is not ArraysCache or not replayable:
            raise ValueError(
                f"speculative decoding needs caches that can drop rejected tokens; {model_type} keeps "
                f"{type(cache).__name__} in layer {index} (a sliding window or a recurrent state "
                f"moe-mesh cannot replay; it replays {', '.join(MIXERS)})"
            )
        if not isinstance(mixer, ReplayableMixer):
            mixer = ReplayableMixer(mixer)
            layer.linear_attn = mixer
        mixers[index] = mixer
    return RecurrentRows(mixers)
