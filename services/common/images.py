"""Image bytes from clients: checked, decoded to RGB pixels, and named by those pixels.

The gateway checks each image a request carries before it reaches core (so a bad one gets a 400
naming the client's field), and core decodes it again for the vision tower. Both use `decode_image`.
An image is named by a hash of its decoded pixels and size, not of its file: the same picture sent
as PNG and as lossless WebP, or re-encoded with other metadata, is the same image to the cache.
"""

from __future__ import annotations

import hashlib
import io
import warnings

import numpy as np

MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WEBP", "image/gif": "GIF"}
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024  # OpenAI's and Anthropic's own per-image caps are 20 and 5 MB
DEFAULT_MAX_IMAGE_PIXELS = 40_000_000  # width x height: a decompression bomb stops here, before decoding


class ImageError(ValueError):
    """An image that cannot be used; `field` names where it came from."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def decode_image(
    data: bytes,
    field: str,
    media_type: str = "",
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
):
    """`data` as an RGB `PIL.Image`, fully decoded. Raises ImageError naming `field` for an empty,
    oversized or unreadable file, a type other than PNG/JPEG/WebP/GIF, a declared `media_type` that
    is not one of those, or more than `max_pixels` pixels (checked from the header, before decoding)."""
    from PIL import Image, UnidentifiedImageError

    if media_type and media_type.lower() not in MEDIA_TYPES:
        raise ImageError(field, f"media type {media_type!r} is not supported; send {', '.join(MEDIA_TYPES)}")
    if not data:
        raise ImageError(field, "the image is empty")
    if len(data) > max_bytes:
        raise ImageError(field, f"the image is {len(data)} bytes, more than the cap of {max_bytes}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=list(MEDIA_TYPES.values()))
            width, height = image.size
            if width * height > max_pixels:
                raise ImageError(
                    field, f"the image is {width}x{height} pixels, more than {max_pixels} in all"
                )
            image.load()
            return image.convert("RGB")
    except ImageError:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
        raise ImageError(field, f"not a PNG, JPEG, WebP or GIF image ({type(error).__name__})") from None
    except (OSError, ValueError, SyntaxError, EOFError) as error:  # truncated or corrupt data
        raise ImageError(field, f"the image could not be decoded: {error}") from None


def pixel_hash(image, variant: str = "") -> str:
    """The image's name: a hash of its size and RGB pixels, whatever file format carried them (and
    of `variant`, where a model makes other features of the same pixels)."""
    pixels = np.asarray(image.convert("RGB"), dtype=np.uint8)
    digest = hashlib.sha256(
        f"{variant + ':' if variant else ''}{pixels.shape[1]}x{pixels.shape[0]}:".encode()
    )
    digest.update(np.ascontiguousarray(pixels).tobytes())
    return digest.hexdigest()
