"""Images by URL through the real HTTP app (--allow-image-urls): fetched from a local server with
its redirects, size and time limits, and only from public addresses unless private ones are allowed."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from services.gateway import image_fetch

from .conftest import GatewayThread
from .core_double import MODEL_ID, CoreDouble, CoreDoubleServer
from .image_bodies import BIG_PNG, CHAT, MESSAGES, PNG, SMALL_CAP, chat, data_url, refused, sent_parts

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
