"""Images in chats, OpenAI's image_url parts and Anthropic's image blocks, through the real HTTP app:
what reaches core (parts in order, the file's bytes, its media type) and the 400 for each bad image."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from services.proto.moemesh.v1 import core_pb2

from .conftest import GatewayThread
from .core_double import MODEL_ID, CoreDouble, CoreDoubleServer
from .image_bodies import (
    CHAT,
    JPEG,
    MESSAGES,
    PNG,
    anthropic_image,
    chat,
    data_url,
    picture,
    refused,
    sent_parts,
)

# ---- OpenAI, inline images --------------------------------------------------------------------


def test_png_data_url_reaches_core_as_parts_in_order(gateway_url: str, core: CoreDouble) -> None:
    body = chat("What is this?", {"url": data_url(PNG), "detail": "low"}, "One word.")
    response = httpx.post(gateway_url + CHAT, json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert sent_parts(core) == [
        ("text", "What is this?"),
        ("image", (PNG, "image/png")),
        ("text", "One word."),
    ]
    system = core.requests[-1].chat.messages[0]  # a message without images maps as before: its text
    assert (system.role, system.content, len(system.parts)) == ("system", "Be brief.", 0)


def test_jpeg_through_the_openai_client(gateway_url: str, core: CoreDouble) -> None:
    client = openai.OpenAI(base_url=gateway_url + "/v1", api_key="unused", max_retries=0, timeout=30)
    completion = client.chat.completions.create(
        model=MODEL_ID,
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "image_url",
                        "image_url": {"url": data_url(JPEG, "image/jpeg"), "detail": "auto"},
                    },
                    {"type": "text", "text": "Describe it."},
                ],
            }
        ],
    )
    assert completion.choices[0].message.content
    assert sent_parts(core) == [("image", (JPEG, "image/jpeg")), ("text", "Describe it.")]


@pytest.mark.parametrize(
    ("url", "words"),
    [
        (data_url(b"not an image at all" * 8), ["PNG, JPEG, WebP or GIF"]),
        (data_url(b"\x89PNG\r\n\x1a\n" + b"not really a png" * 8), ["could not be decoded"]),
        (data_url(PNG[: len(PNG) // 2]), ["could not be decoded"]),  # truncated
        ("data:image/png;base64,iVBORw0KGgo***", ["base64"]),
        ("data:image/png;base64,Zm9v\u00e9", ["base64"]),
        ("data:image/png," + "x" * 20, ["base64"]),
        ("data:image/png;base64", ["comma"]),
        (data_url(picture("BMP"), "image/bmp"), ["image/bmp", "not supported"]),
        (data_url(picture("BMP")), ["PNG, JPEG, WebP or GIF"]),  # a BMP file declared as PNG
        (data_url(b""), ["empty"]),
        ("ftp://example.com/cat.png", ["ftp:"]),
        ("cat.png", ["without a scheme"]),
    ],
    ids=[
        "corrupt",
        "png_signature_then_junk",
        "truncated",
        "bad_base64",
        "non_ascii_base64",
        "not_base64",
        "no_comma",
        "bmp_type",
        "bmp_file",
        "empty",
        "ftp",
        "no_scheme",
    ],
)
def test_a_bad_image_is_a_400_naming_its_field(gateway_url: str, core: CoreDouble, url: str, words) -> None:
    body = chat("Look:", {"url": url})
    refused(httpx.post(gateway_url + CHAT, json=body, timeout=30), "messages[1].content[1].image_url", *words)
    assert core.requests == []


def test_an_image_outside_a_user_message_is_refused(gateway_url: str, core: CoreDouble) -> None:
    for role in ("assistant", "system", "tool"):
        body = chat("Here:", {"url": data_url(PNG)}, role=role)
        if role == "tool":
            body["messages"][-1]["tool_call_id"] = "call_1"
        response = httpx.post(gateway_url + CHAT, json=body, timeout=30)
        message = refused(response, "messages[1]", "content[1]", "user messages only", role)
    assert "image_url" in message and core.requests == []


def test_image_urls_are_off_by_default(gateway_url: str, core: CoreDouble) -> None:
    body = chat({"url": "http://127.0.0.1:9/cat.png"})
    refused(
        httpx.post(gateway_url + CHAT, json=body, timeout=30),
        "messages[1].content[0].image_url",
        "image URLs are off",
        "data: URL",
        "--allow-image-urls",
    )
    assert core.requests == []


def test_tokenize_takes_a_chat_with_an_image(gateway_url: str, core: CoreDouble) -> None:
    response = httpx.post(gateway_url + "/tokenize", json=chat("Hi", {"url": data_url(PNG)}), timeout=30)
    assert response.status_code == 200, response.text
    bad = chat("Hi", {"url": data_url(b"junk")})
    refused(httpx.post(gateway_url + "/tokenize", json=bad, timeout=30), "messages[1].content[1].image_url")


def test_a_20_mb_image_fits_the_body_cap_and_a_larger_body_is_a_clean_413(gateway_url: str) -> None:
    """A body carrying an image at the per-image cap (20 MiB, ~27 MiB in base64) is read (this one
    is refused for its bytes, not its size); one beyond the 32 MiB body cap is a 413 envelope."""
    junk = b"\0" * (20 * 1024 * 1024 - 1024)
    response = httpx.post(gateway_url + CHAT, json=chat({"url": data_url(junk)}), timeout=60)
    refused(response, "messages[1].content[0].image_url", "PNG, JPEG, WebP or GIF")
    response = httpx.post(
        gateway_url + CHAT, json=chat({"url": data_url(junk + junk[:5_000_000])}), timeout=60
    )
    assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"


# ---- Anthropic --------------------------------------------------------------------------------


def test_anthropic_base64_image_reaches_core(gateway_url: str, core: CoreDouble) -> None:
    client = anthropic.Anthropic(base_url=gateway_url, api_key="unused", max_retries=0, timeout=30)
    message = client.messages.create(
        model=MODEL_ID,
        max_tokens=16,
        system="Be brief.",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Compare"},
                    anthropic_image(PNG),
                    {"type": "text", "text": "with"},
                    anthropic_image(JPEG, "image/jpeg"),
                ],
            }
        ],
    )
    assert message.content[0].text
    assert sent_parts(core) == [
        ("text", "Compare"),
        ("image", (PNG, "image/png")),
        ("text", "with"),
        ("image", (JPEG, "image/jpeg")),
    ]
    assert core.requests[-1].chat.messages[0].content == "Be brief."
    counted = client.messages.count_tokens(
        model=MODEL_ID,
        messages=[{"role": "user", "content": [anthropic_image(PNG), {"type": "text", "text": "a b"}]}],
    )
    assert counted.input_tokens >= 0


def test_anthropic_images_and_tool_results_keep_their_order(gateway_url: str, core: CoreDouble) -> None:
    """A user turn is split at its tool_result blocks; the text and images around them stay
    user messages, those with an image as parts."""
    use = {"type": "tool_use", "id": "t1", "name": "look", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "a cat"}
    body = {
        "model": MODEL_ID,
        "max_tokens": 8,
        "messages": [
            {"role": "user", "content": "Look."},
            {"role": "assistant", "content": [use]},
            {
                "role": "user",
                "content": [result, anthropic_image(PNG), {"type": "text", "text": "And this?"}],
            },
        ],
    }
    response = httpx.post(gateway_url + MESSAGES, json=body, timeout=30)
    assert response.status_code == 200, response.text
    sent = core.requests[-1].chat.messages
    assert [(m.role, m.content) for m in sent] == [
        ("user", "Look."),
        ("assistant", ""),
        ("tool", "a cat"),
        ("user", ""),
    ]
    assert sent_parts(core) == [("image", (PNG, "image/png")), ("text", "And this?")]


@pytest.mark.parametrize(
    ("block", "words"),
    [
        (anthropic_image(b"junk"), ["messages[0].content[1].source", "PNG, JPEG, WebP or GIF"]),
        (anthropic_image(PNG, "image/bmp"), ["messages[0].content[1].source", "image/bmp"]),
        (
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "%%%"}},
            ["messages[0].content[1].source", "base64"],
        ),
        (
            {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}},
            ["image URLs are off", "base64 source", "--allow-image-urls"],
        ),
        ({"type": "document", "source": {"type": "text", "data": "x"}}, ["document"]),
    ],
    ids=["corrupt", "bmp", "bad_base64", "url_off", "document"],
)
def test_anthropic_bad_image_is_an_anthropic_400(gateway_url: str, core: CoreDouble, block, words) -> None:
    body = {
        "model": MODEL_ID,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Look:"}, block]}],
    }
    response = httpx.post(gateway_url + MESSAGES, json=body, timeout=30)
    assert response.status_code == 400, response.text
    payload = response.json()
    assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"
    for word in words:
        assert word in payload["error"]["message"], payload
    assert core.requests == []


def test_anthropic_image_in_an_assistant_turn_is_refused(gateway_url: str, core: CoreDouble) -> None:
    body = {
        "model": MODEL_ID,
        "max_tokens": 8,
        "messages": [
            {"role": "user", "content": "Draw a cat."},
            {"role": "assistant", "content": [anthropic_image(PNG)]},
        ],
    }
    response = httpx.post(gateway_url + MESSAGES, json=body, timeout=30)
    assert response.status_code == 400 and response.json()["type"] == "error"
    assert "messages[1]" in response.json()["error"]["message"] and "user turns only" in response.text
    assert core.requests == []


# ---- the mappings alone ------------------------------------------------------------------------


def test_mapping_without_loaded_images_refuses() -> None:
    """A request with images mapped without loading them is a bug, not an image-less prompt."""
    from services.gateway.generate_mapping import build_chat_request
    from services.gateway.openai_schema import ChatCompletionRequest

    request = ChatCompletionRequest.model_validate(chat("Hi", {"url": data_url(PNG)}))
    with pytest.raises(ValueError, match="not loaded"):
        build_chat_request(request, "r")
    image = core_pb2.ImageInput(data=PNG, media_type="image/png")
    built = build_chat_request(request, "r", {(1, 1): image})
    assert [part.WhichOneof("part") for part in built.chat.messages[1].parts] == ["text", "image"]


def test_images_to_a_text_only_model_are_refused_naming_the_clients_field(
    core_server: CoreDoubleServer, core: CoreDouble
) -> None:
    """Core's model list says the model takes text only: the gateway refuses before fetching or
    forwarding anything, naming the field the client sent (and text still serves)."""
    core.images_refused = "takes text only"
    gateway = GatewayThread(core_server.target, allow_image_urls=True).start()  # a fresh model list
    try:
        body = chat("What is this?", {"url": "http://192.0.2.1/never-fetched.png"})
        response = httpx.post(gateway.url + CHAT, json=body, timeout=30)
        message = refused(response, "messages[1].content[1].image_url", f"model '{MODEL_ID}' takes text only")
        assert response.json()["error"]["code"] == "images_not_supported", message
        anthropic_body = {
            "model": MODEL_ID,
            "max_tokens": 8,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}, anthropic_image(PNG)]}],
        }
        for path in (MESSAGES, MESSAGES + "/count_tokens"):
            response = httpx.post(gateway.url + path, json=anthropic_body, timeout=30)
            assert response.status_code == 400 and "takes text only" in response.text, response.text
            assert "messages[0].content[1]" in response.text
        assert core.requests == []
        text = httpx.post(gateway.url + CHAT, json=chat("Hello"), timeout=30)
        assert text.status_code == 200, text.text
    finally:
        gateway.stop()
