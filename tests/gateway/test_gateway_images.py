"""Images in chats, OpenAI's image_url parts and Anthropic's image blocks, through the real HTTP app:
what reaches core (parts in order, the file's bytes, its media type) and the 400 for each bad image."""

from __future__ import annotations

import base64
import http.server
import io
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from PIL import Image

from services.gateway import image_fetch
from services.proto.moemesh.v1 import core_pb2

from .conftest import GatewayThread
from .core_double import MODEL_ID, CoreDouble, CoreDoubleServer

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


# ---- OpenAI, images by URL (--allow-image-urls) ------------------------------------------------


class _ImageServer(http.server.BaseHTTPRequestHandler):
    """/png, /hop/N (N redirects, then /png), /loop, /big (Content-Length), /big-unsized (read to
    the end), /missing, /slow, /to-ftp."""

    def do_GET(self) -> None:
        path = self.path
        if path == "/png":
            self._send(PNG, "image/png")
        elif path.startswith("/hop/"):
            hops = int(path.rsplit("/", 1)[1])
            self._redirect(f"/hop/{hops - 1}" if hops > 1 else "/png")
        elif path in ("/loop", "/loop-back"):
            self._redirect("/loop-back" if path == "/loop" else "/loop")
        elif path == "/to-ftp":
            self._redirect("ftp://127.0.0.1/cat.png")
        elif path == "/big":
            self._send(BIG_PNG, "image/png")
        elif path == "/big-unsized":
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.end_headers()  # HTTP/1.0, no length: the body ends when the connection does
            self.wfile.write(BIG_PNG)
        elif path == "/slow":
            time.sleep(1.5)
            self._send(PNG, "image/png")
        else:
            self.send_error(404)

    def _send(self, data: bytes, media_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", media_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ImageServer)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="image-server", daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def url_gateway(core_server: CoreDoubleServer) -> Iterator[GatewayThread]:
    """A gateway started as with --allow-image-urls --allow-private-image-urls (the image server is
    on loopback), taking images of at most SMALL_CAP bytes."""
    thread = GatewayThread(
        core_server.target,
        model_name_hint=MODEL_ID,
        allow_image_urls=True,
        allow_private_image_urls=True,
        max_image_bytes=SMALL_CAP,
    ).start()
    yield thread
    thread.stop()


def _budget_released(gateway: GatewayThread) -> bool:
    budget = gateway.server.config.app.state.request_memory
    deadline = time.monotonic() + 2
    while budget.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    return budget.in_flight == 0


@pytest.mark.parametrize("path", ["/png", "/hop/3"], ids=["direct", "three_redirects"])
def test_an_image_url_is_fetched(
    url_gateway: GatewayThread, image_server: str, core: CoreDouble, path: str
) -> None:
    body = chat("What is this?", {"url": image_server + path})
    response = httpx.post(url_gateway.url + CHAT, json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert sent_parts(core) == [("text", "What is this?"), ("image", (PNG, "image/png"))]
    assert _budget_released(url_gateway)


def test_anthropic_url_source_is_fetched(
    url_gateway: GatewayThread, image_server: str, core: CoreDouble
) -> None:
    image = {"type": "image", "source": {"type": "url", "url": image_server + "/png"}}
    body = {"model": MODEL_ID, "max_tokens": 8, "messages": [{"role": "user", "content": [image]}]}
    response = httpx.post(url_gateway.url + MESSAGES, json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert sent_parts(core) == [("image", (PNG, "image/png"))]


@pytest.mark.parametrize(
    ("path", "words"),
    [
        ("/hop/4", ["fetching the image failed", "more than 3 redirects"]),
        ("/loop", ["fetching the image failed", "redirect loop"]),
        ("/to-ftp", ["fetching the image failed", "not http(s)"]),
        ("/big", [f"the image is {len(BIG_PNG)} bytes, more than the cap of {SMALL_CAP}"]),
        ("/big-unsized", [f"more than the cap of {SMALL_CAP} bytes"]),
        ("/missing", ["fetching the image failed", "HTTP 404"]),
    ],
)
def test_a_failed_fetch_is_a_400_naming_the_field(
    url_gateway: GatewayThread, image_server: str, core: CoreDouble, path: str, words: list[str]
) -> None:
    body = chat("Look:", {"url": image_server + path}, system=False)
    response = httpx.post(url_gateway.url + CHAT, json=body, timeout=30)
    refused(response, "messages[0].content[1].image_url", *words)
    assert core.requests == [] and _budget_released(url_gateway)


def test_an_unreachable_or_slow_url_is_a_400(
    url_gateway: GatewayThread, image_server: str, core: CoreDouble, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket_closed_port() as port:
        body = chat({"url": f"http://127.0.0.1:{port}/png"})
        refused(httpx.post(url_gateway.url + CHAT, json=body, timeout=30), "messages[1].content[0].image_url")
    monkeypatch.setattr(image_fetch, "FETCH_TIMEOUT_S", 0.3)
    started = time.monotonic()
    body = chat({"url": image_server + "/slow"})
    refused(
        httpx.post(url_gateway.url + CHAT, json=body, timeout=30),
        "messages[1].content[0].image_url",
        "timed out",
    )
    assert time.monotonic() - started < 1.4 and core.requests == []


class socket_closed_port:
    """A loopback port nothing listens on."""

    def __enter__(self) -> int:
        import socket

        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        return self._socket.getsockname()[1]

    def __exit__(self, *exc: object) -> None:
        self._socket.close()


def test_the_cap_holds_for_inline_images_too(url_gateway: GatewayThread, core: CoreDouble) -> None:
    body = chat({"url": data_url(BIG_PNG)})
    response = httpx.post(url_gateway.url + CHAT, json=body, timeout=30)
    refused(response, "messages[1].content[0].image_url", f"more than the cap of {SMALL_CAP}")


# ---- Anthropic --------------------------------------------------------------------------------


def anthropic_image(data: bytes, media_type: str = "image/png") -> dict[str, Any]:
    encoded = base64.b64encode(data).decode()
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": encoded}}


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


# ---- image URLs: public addresses only, unless private ones are allowed ------------------------


@pytest.mark.parametrize(
    ("address", "is_public"),
    [
        ("8.8.8.8", True),
        ("2001:4860:4860::8888", True),
        ("127.0.0.1", False),
        ("10.1.2.3", False),
        ("172.16.0.1", False),
        ("192.168.1.1", False),
        ("169.254.169.254", False),  # cloud metadata services
        ("100.64.0.1", False),  # shared address space (CGNAT)
        ("0.0.0.0", False),
        ("224.0.0.1", False),
        ("::1", False),
        ("fd00::1", False),
        ("fe80::1%eth0", False),
        ("::ffff:127.0.0.1", False),  # IPv4-mapped loopback
    ],
)
def test_public_addresses(address: str, is_public: bool) -> None:
    assert image_fetch.public(address) is is_public


@pytest.fixture(scope="module")
def public_url_gateway(core_server: CoreDoubleServer) -> Iterator[GatewayThread]:
    thread = GatewayThread(core_server.target, model_name_hint=MODEL_ID, allow_image_urls=True).start()
    yield thread
    thread.stop()


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]", "169.254.169.254", "10.0.0.1"])
def test_image_urls_to_private_addresses_are_refused_by_default(
    public_url_gateway: GatewayThread, image_server: str, core: CoreDouble, host: str
) -> None:
    port = image_server.rsplit(":", 1)[1]
    body = chat({"url": f"http://{host}:{port}/png"})
    response = httpx.post(public_url_gateway.url + CHAT, json=body, timeout=30)
    refused(
        response, "messages[1].content[0].image_url", "not a public address", "--allow-private-image-urls"
    )
    assert core.requests == [] and _budget_released(public_url_gateway)


def test_a_name_that_resolves_elsewhere_at_connect_time_is_refused(
    image_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The URL's host passes the check as a public address, then resolves to loopback when the
    socket connects (DNS rebinding): the connection is refused, the loopback server never asked."""
    port = int(image_server.rsplit(":", 1)[1])
    answers = iter(["93.184.216.34", "127.0.0.1"])
    real = image_fetch.socket.getaddrinfo

    def rebinding(host, *args, **kwargs):
        if host != "images.example":
            return real(host, *args, **kwargs)
        return [(image_fetch.socket.AF_INET, image_fetch.socket.SOCK_STREAM, 6, "", (next(answers), port))]

    monkeypatch.setattr(image_fetch.socket, "getaddrinfo", rebinding)
    with pytest.raises(image_fetch.ImageError) as raised:
        image_fetch.download(f"http://images.example:{port}/png", "f", SMALL_CAP)
    assert "not a public address" in str(raised.value) and "127.0.0.1" in str(raised.value)


def test_a_redirect_to_a_private_address_is_refused() -> None:
    redirects = image_fetch._HttpRedirects(allow_private=False)
    request = image_fetch.urllib.request.Request("http://93.184.216.34/cat.png")
    with pytest.raises(image_fetch.PrivateAddress):
        redirects.redirect_request(request, None, 302, "Found", {}, "http://127.0.0.1:9/cat.png")
    allowed = image_fetch._HttpRedirects(allow_private=True)
    assert allowed.redirect_request(request, None, 302, "Found", {}, "http://127.0.0.1:9/cat.png") is not None
