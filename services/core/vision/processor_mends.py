"""Where mlx-vlm's image processors part from the model's own, mended before core uses them.

mlx-vlm's Llama 4 processor (a torch-free stand-in for Hugging Face's) writes each tiled image's
prompt as Hugging Face's does, its tiles and then the whole image, but makes no pixels for the
whole image: the prompt then has one tile's positions more than the vision tower gives features
for, and mlx-vlm's merge reads past the end of them. Hugging Face's processor adds that global
tile, the whole image resized to one tile, whenever an image is cut into more than one; so does
the mend here.
"""

from __future__ import annotations

from PIL import Image


def _with_global_tile(image_processor) -> None:
    split = image_processor._split_into_tiles

    def split_into_tiles(image, aspect_ratio):
        tiles = split(image, aspect_ratio)
        if len(tiles) > 1:
            tiles.append(image.resize((image_processor.size, image_processor.size), Image.BICUBIC))
        return tiles

    image_processor._split_into_tiles = split_into_tiles


# processor class name -> what its image processor needs
_MENDS = {"Llama4Processor": _with_global_tile}


def mend_processor(processor):
    """`processor` (mlx-vlm's, as `load_processor` gives it), mended in place where listed above."""
    mend = _MENDS.get(type(processor).__name__)
    if mend is not None and not getattr(processor, "_moe_mesh_mended", False):
        mend(processor.image_processor)
        processor._moe_mesh_mended = True
    return processor
