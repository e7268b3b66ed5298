"""A chat's images, made ready on the request thread: decoded, named, preprocessed, given positions.

The chat template renders each image part as one placeholder token: the processor's `image_token`
(Llama 4's `<|image|>`), else the model's image token. Each image is decoded and checked
(services/common/images.py), named by the hash of its pixels, and run with that one token through
the checkpoint's own processor, as `mlx_vlm.generate` runs it (`mlx_vlm.utils.prepare_inputs`): the
placeholder becomes what the processor makes of it in text (as many image tokens as the vision
tower gives, and the vision markers of a family whose processor adds them, between tiles too).
What the processor made is kept by that hash (`processed`), so an image sent again skips it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from services.common.images import ImageError, decode_image, pixel_hash
from services.core.vision.kept_by_image import KeptByImage
from services.core.vision.processor_mends import images_in_prompt, mend_processor, variant
from services.proto.moemesh.v1 import core_pb2

MAX_IMAGES_PER_REQUEST = 32


@dataclass(frozen=True)
class PromptImage:
    hash: str  # of the decoded pixels: the vision cache's and the prefix cache's key
    pixel_values: np.ndarray  # the image processor's patches
    grid_thw: tuple[int, int, int] | None  # patches in time, height and width, before merging
    tokens: int  # prompt positions it fills
    expansion: tuple[int, ...]  # what its one token becomes in the prompt: its positions and markers
    # the processor's other outputs, as the family's `get_input_embeddings` takes them
    tower_inputs: Mapping = field(default_factory=dict)
    # where its positions lie, counted from the first (a tiled image's tiles are split by markers);
    # empty: `tokens` positions in a row
    offsets: tuple[int, ...] = ()

    @property
    def layout(self) -> tuple[int, ...]:
        """Its positions, counted from the first."""
        return self.offsets or tuple(range(self.tokens))

    @property
    def nbytes(self) -> int:
        """Bytes of its arrays."""
        arrays = [self.pixel_values, *(v for v in self.tower_inputs.values() if isinstance(v, np.ndarray))]
        return sum(a.nbytes for a in arrays)

    @property
    def span(self) -> int:
        """Prompt positions from its first to just past its last."""
        return self.offsets[-1] + 1 if self.offsets else self.tokens


@dataclass(frozen=True)
class PromptImages:
    images: tuple[PromptImage, ...]
    token_id: int  # the prompt token that stands for an image position


def template_content(message: core_pb2.ChatMessage) -> list[dict]:
    """A message's parts as the chat template takes them (images as `{"type": "image"}`)."""
    return [
        {"type": "text", "text": part.text} if part.WhichOneof("part") == "text" else {"type": "image"}
        for part in message.parts
    ]


def image_parts(chat: core_pb2.ChatInput) -> list[tuple[str, core_pb2.ImageInput]]:
    """(field, image) of every image in the chat, in prompt order."""
    return [
        (f"chat.messages[{m}].parts[{p}].image", part.image)
        for m, message in enumerate(chat.messages)
        for p, part in enumerate(message.parts)
        if part.WhichOneof("part") == "image"
    ]


class ImagePreparer:
    """Turns a chat's images and its rendered prompt into the prompt the vision path runs."""

    def __init__(self, processor_dir: Path, config: dict, token_id: int, cache_bytes: int):
        from mlx_vlm.utils import get_model_and_args, load_processor, prepare_inputs

        get_model_and_args(config=dict(config))  # the family's processor registers on import
        with contextlib.redirect_stdout(sys.stderr):  # DeepSeek-VL2's prints the tokens it adds
            self.processor = mend_processor(load_processor(str(processor_dir), add_detokenizer=False))
        self.token_id = token_id
        tokenizer = self.processor.tokenizer
        named = getattr(self.processor, "image_token", None)
        self.placeholder = named if isinstance(named, str) else tokenizer.convert_ids_to_tokens(token_id)
        self.placeholder_id = tokenizer.convert_tokens_to_ids(self.placeholder)
        self.bos_id = tokenizer.bos_token_id
        self._prepare_inputs = prepare_inputs  # mlx-vlm is imported only where images are served
        self.processed = KeptByImage(cache_bytes)

    def prepare(
        self, parts: list[tuple[str, core_pb2.ImageInput]], prompt: list[int]
    ) -> tuple[list[int], PromptImages]:
        """The prompt with each image's token expanded, and the images. Raises ImageError naming
        the field of an image that cannot be used, or "images" where the template placed a
        different number of image tokens than there are images."""
        if len(parts) > MAX_IMAGES_PER_REQUEST:
            raise ImageError("images", f"{len(parts)} images; at most {MAX_IMAGES_PER_REQUEST} per request")
        processed_as = variant(self.processor, len(parts))
        with images_in_prompt(len(parts)):
            images = tuple(self._one(field, image, processed_as) for field, image in parts)
        placed = [i for i, token in enumerate(prompt) if token == self.placeholder_id]
        if len(placed) != len(images):
            raise ImageError(
                "images",
                f"the chat template placed {len(placed)} image placeholders for {len(images)} images",
            )
        expanded: list[int] = []
        start = 0
        for at, image in zip(placed, images, strict=True):
            expanded += prompt[start:at] + list(image.expansion)
            start = at + 1
        expanded += prompt[start:]
        return expanded, PromptImages(images, self.token_id)

    def _one(self, field: str, image: core_pb2.ImageInput, processed_as: str) -> PromptImage:
        picture = decode_image(image.data, field, image.media_type)
        key = pixel_hash(picture, processed_as)
        kept = self.processed.get(key)
        if kept is None:
            kept = self._process(field, picture, key)
            self.processed.put(key, kept, kept.nbytes)
        return kept

    def _process(self, field: str, picture, key: str) -> PromptImage:
        try:
            out = dict(self._prepare_inputs(self.processor, images=[picture], prompts=[self.placeholder]))
        except Exception as error:  # noqa: BLE001 - a processor refuses odd sizes in its own words
            raise ImageError(field, f"the model's image processor refused it: {error}") from None
        expansion = tuple(int(t) for t in np.asarray(out.pop("input_ids")).reshape(-1))
        out.pop("attention_mask", None)
        pixels = np.asarray(out.pop("pixel_values"))
        grid = _grid_thw(out)
        start = 1 if expansion[:1] == (self.bos_id,) and self.bos_id != self.token_id else 0
        expansion = expansion[start:]  # a start of text the processor puts before every prompt
        at = [i for i, token in enumerate(expansion) if token == self.token_id]
        tokens = len(at)
        if tokens == 0:  # a processor that crops to whole patches may leave nothing of a tiny image
            raise ImageError(
                field,
                f"{picture.width}x{picture.height} pixels are too small for this model: its image "
                "processor leaves no patch of them",
            )
        offsets = tuple(i - at[0] for i in at)
        contiguous = offsets[-1] == tokens - 1
        return PromptImage(
            key,
            pixels,
            grid,
            tokens,
            expansion,
            _tower_inputs(out, start + len(expansion), [start + i for i in at]),
            () if contiguous else offsets,
        )


def _tower_inputs(out: dict, length: int, positions: list[int]) -> dict:
    """The processor's other outputs, as the tower takes them for the image's positions alone, arrays
    as NumPy's: one per prompt position (DeepSeek-VL2's `images_seq_mask`, over the `length` it made)
    is cut to `positions`; what describes the prompt's text (its labels, format and length) goes."""
    inputs = {}
    for name, value in out.items():
        if name in ("labels", "sft_format", "seq_lens"):
            continue
        # made concrete here: MLX arrays are bound to this thread's stream
        array = np.asarray(value) if hasattr(value, "shape") else None
        inputs[name] = (
            value if array is None else array[:, positions] if array.shape == (1, length) else array
        )
    return inputs


def _grid_thw(out: dict) -> tuple[int, int, int] | None:
    """An image's patch grid (time, height, width) from its processor's outputs: Qwen-style
    `image_grid_thw`, or Kimi-style `image_grid_hws` (one frame); None from a processor that gives
    none (Llama 4's fixed-size tiles)."""
    if "image_grid_thw" in out:
        return tuple(int(v) for v in np.asarray(out["image_grid_thw"]).reshape(-1)[:3])
    if "image_grid_hws" in out:
        height, width = (int(v) for v in np.asarray(out["image_grid_hws"]).reshape(-1)[:2])
        return 1, height, width
    return None
