"""Request bodies and checks for the gateway's image tests: pictures in several formats, OpenAI chat
bodies with image parts, Anthropic image blocks, and the 400 envelope that names a field."""

from __future__ import annotations

import base64
import io
import os
from typing import Any

import httpx
from PIL import Image

from .core_double import MODEL_ID, CoreDouble

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
SMALL_CAP = 10_000  # bytes: the gateway with URLs on takes no larger image


def picture(fmt: str = "PNG", size: tuple[int, int] = (32, 24)) -> bytes:
    """A width x height RGB gradient, encoded as `fmt`."""
    width, height = size
    image = Image.new("RGB", size)
    image.putdata([(x * 255 // width, y * 255 // height, 128) for y in range(height) for x in range(width)])
    out = io.BytesIO()
    image.save(out, fmt)
    return out.getvalue()


def noise_png(side: int) -> bytes:
    """A PNG that does not compress: about 3 * side**2 bytes."""
    out = io.BytesIO()
    Image.frombytes("RGB", (side, side), os.urandom(side * side * 3)).save(out, "PNG")
    return out.getvalue()


PNG, JPEG = picture("PNG"), picture("JPEG")
BIG_PNG = noise_png(96)
assert len(PNG) < SMALL_CAP < len(BIG_PNG)


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def chat(*content: Any, role: str = "user", system: bool = True) -> dict[str, Any]:
    """A chat body whose last message holds `content` as parts: strings become text parts, others
    are image URLs."""
    parts = [
        {"type": "text", "text": part} if isinstance(part, str) else {"type": "image_url", "image_url": part}
        for part in content
    ]
    messages = [{"role": "system", "content": "Be brief."}] if system else []
    return {"model": MODEL_ID, "messages": [*messages, {"role": role, "content": parts}]}


def refused(response: httpx.Response, param: str, *words: str) -> str:
    """The OpenAI envelope of a 400 naming `param`; its message names it too, and `words`."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert error["message"].startswith(param) and "Traceback" not in error["message"]
    for word in words:
        assert word in error["message"], error
    return error["message"]


def sent_parts(core: CoreDouble, message: int = -1) -> list[tuple[str, Any]]:
    """The parts of one message of the last GenerateRequest: ("text", text) or ("image", (bytes, type))."""
    chat_message = core.requests[-1].chat.messages[message]
    assert chat_message.content == ""  # a message with images carries its content as parts
    return [
        ("text", part.text)
        if part.WhichOneof("part") == "text"
        else ("image", (part.image.data, part.image.media_type))
        for part in chat_message.parts
    ]


def anthropic_image(data: bytes, media_type: str = "image/png") -> dict[str, Any]:
    encoded = base64.b64encode(data).decode()
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": encoded}}
