"""The images of a chat request, read, fetched and checked before the request goes to core.

An image arrives inline (an OpenAI `data:` URL, an Anthropic base64 source) or as an http(s) URL.
URLs are fetched only when the gateway runs with --allow-image-urls, and only from public addresses
unless it also runs with --allow-private-image-urls (image_fetch.py). Every image is checked here with
`decode_image`, the check core repeats, so a corrupt, oversized or unsupported image is a 400 naming
the client's field (`messages[1].content[0].image_url`) rather than a failure inside core.

The cost is bounded (memory_bound.py): base64 decoding and image checks run in threads, off the
event loop, IMAGE_DECODES_AT_ONCE at a time; downloads IMAGE_FETCHES_AT_ONCE at a time, each capped
in bytes, redirects and time; a fetched file is held in the budget of request bodies (429 when full)
until the response is under way.

What reaches core is keyed by position: `Images` maps (message index, part or block index) in the
client's request to the file's bytes and declared media type; the mappings put them in order.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass

from services.common.images import DEFAULT_MAX_IMAGE_BYTES, ImageError, decode_image
from services.gateway.anthropic_schema import Base64ImageSource, ImageBlock, MessagesInput
from services.gateway.errors import OpenAIError
from services.gateway.image_fetch import URL_SCHEMES, download, scheme
from services.gateway.memory_bound import IMAGE_DECODES_AT_ONCE, IMAGE_FETCHES_AT_ONCE, RequestMemoryBudget
from services.gateway.openai_schema import ChatCompletionRequest, ImageContentPart
from services.proto.moemesh.v1 import core_pb2

ImageKey = tuple[int, int]  # (message index, content part or block index) in the client's request
Images = Mapping[ImageKey, core_pb2.ImageInput]

DATA_URL_HINT = "as a data: URL, data:image/png;base64,..."
BASE64_HINT = 'as a base64 source, {"type": "base64", "media_type": ..., "data": ...}'


@dataclass(frozen=True)
class ImageSource:
    """One image as the client sent it: a URL (data: or http(s)) or base64 text."""

    key: ImageKey
    field: str  # the client's name for it, in errors
    inline_hint: str  # how this API sends an image inline, named where URLs are refused
    url: str = ""
    data: str = ""
    media_type: str = ""


def chat_image_sources(request: ChatCompletionRequest) -> list[ImageSource]:
    """The image_url parts of an OpenAI chat (the schema admits them in user messages only)."""
    return [
        ImageSource((i, j), f"messages[{i}].content[{j}].image_url", DATA_URL_HINT, url=part.image_url.url)
        for i, message in enumerate(request.messages)
        if isinstance(message.content, list)
        for j, part in enumerate(message.content)
        if isinstance(part, ImageContentPart)
    ]


def messages_image_sources(request: MessagesInput) -> list[ImageSource]:
    """The image blocks of an Anthropic conversation (the schema admits them in user turns only)."""
    sources = []
    for i, message in enumerate(request.messages):
        for j, block in enumerate(message.blocks()):
            if not isinstance(block, ImageBlock):
                continue
            field = f"messages[{i}].content[{j}].source"
            if isinstance(block.source, Base64ImageSource):
                source = ImageSource(
                    (i, j), field, BASE64_HINT, data=block.source.data, media_type=block.source.media_type
                )
            else:
                source = ImageSource((i, j), field, BASE64_HINT, url=block.source.url)
            sources.append(source)
    return sources


class ImageLoader:
    """The app's image policy (URLs allowed or not, the byte cap) and its limits on work at once."""

    def __init__(
        self,
        *,
        allow_urls: bool = False,
        allow_private_urls: bool = False,
        max_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
        budget: RequestMemoryBudget | None = None,
    ) -> None:
        self.allow_urls = allow_urls
        self.allow_private_urls = allow_private_urls
        self.max_bytes = max_bytes
        self.budget = budget
        self._fetches = asyncio.Semaphore(IMAGE_FETCHES_AT_ONCE)
        self._decodes = asyncio.Semaphore(IMAGE_DECODES_AT_ONCE)

    @asynccontextmanager
    async def load(self, sources: list[ImageSource], refusal: str = "") -> AsyncIterator[Images]:
        """The sources' images, each checked; a bad one raises a 400 naming its field, and so does
        the first where the model refuses images (`refusal`, served_model.image_refusal). Fetched
        files stay reserved in the budget until the block ends."""
        if sources and refusal:
            field = sources[0].field
            raise OpenAIError(400, f"{field}: {refusal}", param=field, code="images_not_supported")
        images: dict[ImageKey, core_pb2.ImageInput] = {}
        held = 0
        try:
            for source in sources:
                try:
                    if scheme(source.url) in URL_SCHEMES:
                        data, media_type = await self._fetch(source)
                        if self.budget is not None and not self.budget.reserve(len(data)):
                            raise OpenAIError(
                                429,
                                "the gateway is busy: fetched images fill its request memory",
                                code="gateway_busy",
                            )
                        held += len(data)
                        await self._check_in_thread(
                            decode_image, data, source.field, media_type, self.max_bytes
                        )
                    else:
                        data, media_type = await self._check_in_thread(_inline_image, source, self.max_bytes)
                except ImageError as error:
                    raise OpenAIError(400, str(error), param=error.field, code="invalid_image") from None
                images[source.key] = core_pb2.ImageInput(data=data, media_type=media_type)
            yield images
        finally:
            if self.budget is not None:
                self.budget.release(held)

    async def _check_in_thread(self, check, *args):
        """An image check (with the base64 decoding before it) in a thread, a few at a time."""
        async with self._decodes:
            return await asyncio.to_thread(check, *args)

    async def _fetch(self, source: ImageSource) -> tuple[bytes, str]:
        if not self.allow_urls:
            raise OpenAIError(
                400,
                f"{source.field}: image URLs are off on this gateway; send the image inline "
                f"({source.inline_hint}), or start the gateway with --allow-image-urls",
                param=source.field,
                code="image_urls_disabled",
            )
        async with self._fetches:
            return await asyncio.to_thread(
                download, source.url, source.field, self.max_bytes, self.allow_private_urls
            )


def _inline_image(source: ImageSource, max_bytes: int) -> tuple[bytes, str]:
    """A data: URL's or a base64 source's file, checked. Runs in a thread."""
    if source.url:
        named = scheme(source.url)
        if named != "data":
            shown = f"{named}: URLs" if named else "a URL without a scheme"
            raise ImageError(source.field, f"images are sent as data: or http(s) URLs, not {shown}")
        data, media_type = _data_url(source.url, source.field)
    else:
        data, media_type = _base64(source.data, source.field), source.media_type
    decode_image(data, source.field, media_type, max_bytes=max_bytes)
    return data, media_type.lower()


def _data_url(url: str, field: str) -> tuple[bytes, str]:
    """`data:image/png;base64,<data>` → the file and its media type ("" where none is named)."""
    header, comma, payload = url[len("data:") :].partition(",")
    if not comma:
        raise ImageError(field, "the data: URL has no comma before its data")
    media_type, *parameters = (item.strip() for item in header.split(";"))
    if "base64" not in (parameter.lower() for parameter in parameters):
        raise ImageError(field, "the data: URL must carry the image in base64 (data:image/png;base64,...)")
    return _base64(payload, field), media_type


def _base64(text: str, field: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):  # ValueError: characters beyond ASCII
        raise ImageError(field, "the image data is not valid base64") from None
