"""Where mlx-vlm's image processors part from the model's own, or from one image at a time, mended
before core uses them.

mlx-vlm's Llama 4 processor (a torch-free stand-in for Hugging Face's) writes each tiled image's
prompt as Hugging Face's does, its tiles and then the whole image, but makes no pixels for the
whole image: the prompt then has one tile's positions more than the vision tower gives features
for, and mlx-vlm's merge reads past the end of them. Hugging Face's processor adds that global
tile, the whole image resized to one tile, whenever an image is cut into more than one; so does
the mend here.

DeepSeek-VL2's processor cuts images into tiles only in a prompt of at most two images (beyond,
each image is its global view and one tile). Core runs the processor on one image at a time, so
the prompt's count is told to it (`images_in_prompt`), and `variant` names the images made so:
the same pixels make other positions and features, and their cache keys must differ.

Step-3.7's processor looks its image token up in the tokenizer's whole vocabulary, which the
tokenizer builds afresh at every call (all of Qwen's 151k tokens, twice per image): the vocabulary
is built once, when the processor loads.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

from PIL import Image

_prompt = threading.local()  # the count of images in the prompt being prepared on this thread
_MOST_IMAGES_CUT = 2  # DeepSeek-VL2's


@contextmanager
def images_in_prompt(count: int):
    """Processors that cut images by the prompt's count of them read `count` within."""
    _prompt.images = count
    try:
        yield
    finally:
        del _prompt.images


def _with_global_tile(processor) -> None:
    image_processor = processor.image_processor
    split = image_processor._split_into_tiles

    def split_into_tiles(image, aspect_ratio):
        tiles = split(image, aspect_ratio)
        if len(tiles) > 1:
            tiles.append(image.resize((image_processor.size, image_processor.size), Image.BICUBIC))
        return tiles

    image_processor._split_into_tiles = split_into_tiles


def _cut_by_prompt_images(processor) -> None:
    tokenize = processor.tokenize_with_images

    def tokenize_with_images(conversation, images, bos=True, eos=True, cropping=True):
        count = getattr(_prompt, "images", len(images))
        return tokenize(conversation, images, bos=bos, eos=eos, cropping=count <= _MOST_IMAGES_CUT)

    processor.tokenize_with_images = tokenize_with_images


def _vocabulary_built_once(processor) -> None:
    tokenizer = processor.tokenizer
    vocabulary = tokenizer.get_vocab()
    tokenizer.get_vocab = lambda: vocabulary


# processor class name -> what it needs
_MENDS = {
    "Llama4Processor": _with_global_tile,
    "DeepseekVLV2Processor": _cut_by_prompt_images,
    "Step3VLProcessor": _vocabulary_built_once,
}


def mend_processor(processor):
    """`processor` (mlx-vlm's, as `load_processor` gives it), mended in place where listed above."""
    mend = _MENDS.get(type(processor).__name__)
    if mend is not None and not getattr(processor, "_moe_mesh_mended", False):
        mend(processor)
        processor._moe_mesh_mended = True
    return processor


def variant(processor, count: int) -> str:
    """What sets images processed in a prompt of `count` images apart from the same pixels in a
    prompt of one ("" where nothing does)."""
    if type(processor).__name__ == "DeepseekVLV2Processor" and count > _MOST_IMAGES_CUT:
        return "uncut"
    return ""
