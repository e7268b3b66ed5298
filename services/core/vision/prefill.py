"""A prompt with images, prefilled into a sequence's KV cache through mlx-vlm's language model.

The vision tower encodes each image once (its features are kept by pixel hash, `features`);
the prompt's embeddings get those features at the image positions, and mlx-vlm's language model
runs the prompt, bar its last token, into the cache the engine then decodes from.

Two ways to run the prompt. Families with 3-D positions (Qwen-VL, GLM-4.5V) run mlx-vlm's language
model (its 3-D positions, and DeepStack inputs where it has them), made of core's own modules. Families with plain 1-D positions run core's own
language model: its token embeddings are replaced, for that one call, by the prompt's embeddings with
the image features in place (`EmbeddingsOnce`), so the prompt goes through the very code that
decodes it.

Positions. These families give image positions 3-D rotary positions that advance less than one per
token, so decoding continues from `cache offset + delta` (delta <= 0), where mlx-lm's text model,
which decodes here, rotates at the cache offset. Rotary attention depends only on position
differences, so the prompt is prefilled at its positions minus delta: every score is the model's
own, and decoding at the cache offset continues exactly where the prompt left off.
"""

from __future__ import annotations

from bisect import bisect_left
from contextlib import nullcontext

import mlx.core as mx
import numpy as np
from mlx import nn

from services.core.kv.sdpa_hook import install_turboquant_attention
from services.core.vision.image_blocks import ImagesAttendBothWays, same_image, whole_images_stop
from services.core.vision.kept_by_image import KeptByImage
from services.core.vision.prompt_images import PromptImages


class EmbeddingsOnce(dict):
    """Stands in for a language model's `embed_tokens` for one call: returns `embeds` for `ids`,
    and puts the real module back as it is called, before anything else can embed. An empty dict
    to MLX's module tree (it holds its arrays as plain attributes), which takes it in the real
    module's place, in order, and finds no parameters in it."""

    def __init__(self, owner: nn.Module, ids: mx.array, embeds: mx.array):
        super().__init__()
        self._owner, self._ids, self._embeds = owner, ids, embeds
        self._real = owner.embed_tokens

    def __enter__(self):
        self._owner.embed_tokens = self
        return self

    def __exit__(self, *_):
        self._owner.embed_tokens = self._real

    def __call__(self, ids: mx.array) -> mx.array:
        self._owner.embed_tokens = self._real
        if ids is not self._ids:
            raise RuntimeError("the language model embedded other tokens than the prompt's")
        return self._embeds


def embeddings_owner(model: nn.Module) -> nn.Module:
    """The module of `model` that embeds the prompt (holds `embed_tokens`) and runs the layers."""
    modules = dict(model.named_modules())
    for path in modules:
        if path == "embed_tokens" or path.endswith(".embed_tokens"):
            return modules[path.rpartition(".")[0]] if "." in path else model
    raise ValueError("the language model has no embed_tokens")


class VisionPrefill:
    def __init__(
        self, model: nn.Module, cache_bytes: int, text_model: nn.Module | None = None, both_ways: bool = False
    ):
        """`model`: mlx-vlm's model. Without `text_model` its language model is made of core's
        modules (tower.share_language_modules) and runs the prompt; with it, only its embeddings
        are core's (tower.share_embeddings) and `text_model`, core's own, runs the prompt.
        `both_ways`: an image's positions attend to each other both ways (image_blocks.py)."""
        self.model = model
        self.language = model.language_model
        self.features = KeptByImage(cache_bytes)  # vision-tower outputs per image hash
        self.own_model = None if text_model is None else embeddings_owner(text_model)
        # a text model that scales its token embeddings (Gemma's) scales what stands in for them
        self.embed_scale = getattr(self.own_model, "embed_scale", 1.0)
        self.both_ways = both_ways
        if both_ways and not hasattr(self.own_model, "_make_masks"):  # (1-D positions, core's model)
            raise ValueError("this family's images attend both ways, in masks core cannot open")
        install_turboquant_attention(model)  # attention over TurboQuant caches, as in core's model

    def _encode(self, image, token_id: int) -> tuple[mx.array, list[mx.array] | None]:
        found = self.features.get(image.hash)
        if found is not None:
            return found
        if self.own_model is None:
            dtype = self.model.vision_tower.patch_embed.proj.weight.dtype
            pixels = mx.array(image.pixel_values).astype(dtype)
            out = self.model.vision_tower(pixels, mx.array([image.grid_thw]))
            hidden, deep = out if isinstance(out, tuple) else (out, None)
            deep = deep or None  # a tower without DeepStack outputs may give an empty list
        else:  # the family's own merge of features into image positions, over image positions only
            ids = mx.array([[token_id] * image.tokens])
            # masks stay NumPy's: a family's merge may read them with NumPy (DeepSeek-VL2's does)
            inputs = {
                k: mx.array(v) if isinstance(v, np.ndarray) and v.dtype != np.bool_ else v
                for k, v in image.tower_inputs.items()
            }
            merged = self.model.get_input_embeddings(
                ids, mx.array(image.pixel_values), **{**inputs, "image_token_id": token_id}
            )
            hidden, deep = merged.inputs_embeds[0] / self.embed_scale, None
        mx.eval(hidden, deep)
        nbytes = hidden.nbytes + sum(d.nbytes for d in deep or [])
        self.features.put(image.hash, (hidden, deep), nbytes)
        return hidden, deep

    def positions(self, prompt: list[int], images: PromptImages) -> tuple[mx.array | None, int]:
        """The prompt's rotary positions shifted to end at len(prompt) - 1 ([3, 1, L] for 3-D
        positions; None where the model has plain 1-D ones), and the shift."""
        if self.own_model is not None:  # plain positions (tower.plain_positions)
            return None, 0
        grids = mx.array([image.grid_thw for image in images.images], dtype=mx.int32)
        position_ids, deltas = self.language.get_rope_index(mx.array([prompt]), grids)
        shift = int(deltas.reshape(-1)[0].item())
        return position_ids - shift, shift

    def window_stop(self, prompt: list[int], images: PromptImages, stop: int) -> int:
        """Where a prefill window ending at `stop` may end: past any image it would cut, where
        image positions attend both ways."""
        if not self.both_ways:
            return stop
        return whole_images_stop(image_spans(prompt, images), stop, len(prompt) - 1)

    def prefill(
        self,
        cache: list,
        prompt: list[int],
        images: PromptImages,
        positions: mx.array | None,
        start: int,
        stop: int,
    ) -> int:
        """Run `prompt[start:stop]` (`stop` at most its last position, which the engine's batch
        computes) into `cache`, which holds `prompt[:start]`, at `positions` (`self.positions`);
        returns the positions the cache then holds. Only the images in that window are encoded."""
        end = min(stop, len(prompt) - 1)
        if start >= end:
            return end
        ids = mx.array([prompt[start:end]])
        owner = self.language.model if self.own_model is None else self.own_model
        embeds = owner.embed_tokens(ids)
        where, rows, deep_rows = [], [], []
        spans = image_spans(prompt, images)
        for first, image in spans:
            layout = image.layout
            # the image's rows whose positions fall in the window
            a, b = bisect_left(layout, start - first), bisect_left(layout, end - first)
            if a >= b:
                continue
            hidden, deep = self._encode(image, images.token_id)
            where += [first + offset - start for offset in layout[a:b]]
            rows.append(hidden[a:b])
            if deep is not None:
                deep_rows.append([level[a:b] for level in deep])
        if where:
            embeds[0, mx.array(where, dtype=mx.uint32)] = mx.concatenate(rows).astype(embeds.dtype)
        if self.own_model is not None:
            both_ways = nullcontext()
            if self.both_ways:
                both_ways = ImagesAttendBothWays(owner, same_image(spans, start, end))
            with EmbeddingsOnce(owner, ids, embeds), both_ways:
                owner(ids, cache=cache)
        else:
            kwargs = {"inputs_embeds": embeds, "cache": cache}
            if positions is not None:
                kwargs["position_ids"] = positions[..., start:end]
            if deep_rows:  # the window's image positions, and their DeepStack rows in the same order
                kwargs["visual_pos_masks"] = ids == images.token_id
                kwargs["deepstack_visual_embeds"] = [
                    mx.concatenate(level) for level in zip(*deep_rows, strict=True)
                ]
            owner(ids, **kwargs)
        mx.eval([c.state for c in cache])
        return end


def image_spans(prompt: list[int], images: PromptImages) -> list[tuple[int, object]]:
    """(first position, image) of each image in the prompt, in order."""
    spans, i, pending = [], 0, iter(images.images)
    while i < len(prompt):
        image = next(pending, None) if prompt[i] == images.token_id else None
        if image is None:
            i += 1
            continue
        spans.append((i, image))
        i += image.span
    return spans


def prefix_key(kind: str, tokens: list[int], images: PromptImages, shift: int) -> tuple[str, list[int]]:
    """The prefix cache's (kind, tokens) for a sequence with images: each image's positions become a
    negative id from its pixel hash (no text token and no other image matches them), and the kind
    carries the position shift (a cache prefilled at another shift is not reusable)."""
    key = list(tokens)
    for first, image in image_spans(key, images):
        for offset in image.layout:
            if first + offset < len(key):  # `tokens` may end inside an image
                key[first + offset] = -1 - int(image.hash[:12], 16)
    return f"{kind}@images{shift}", key
