"""Fetching an image URL (--allow-image-urls): http(s) only, capped in bytes, time and redirects, and
by default only from public addresses.

A fetch goes where the client points it. Unless the gateway runs with --allow-private-image-urls,
a host that resolves to a loopback, private, link-local, shared (CGNAT), multicast or reserved
address is refused: the gateway's own network and the machine's metadata services are not the
client's to read. The check runs on the URL and every redirect, and again on the address the
socket connects to, so a name that resolves differently a moment later gains nothing. Through a
proxy from the environment the URL's host is checked and the proxy, the operator's own, is trusted.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import time
import urllib.error
import urllib.parse
import urllib.request

from services.common.images import MEDIA_TYPES, ImageError

FETCH_TIMEOUT_S = 10.0  # for each network operation, and for the whole download (checked between reads)
MAX_REDIRECTS = 3
URL_SCHEMES = ("http", "https")
READ_CHUNK_BYTES = 64 * 1024


class PrivateAddress(OSError):
    """The host of a URL, or the address a socket would connect to, is not public."""


def public(address: str) -> bool:
    """Whether `address` (an IP, v4 or v6) is one the internet routes to anyone."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def _resolve(host: str, port: int) -> list[tuple]:
    try:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise OSError(f"cannot resolve {host!r}: {error.strerror}") from None


def check_host(url: str) -> None:
    """Raise PrivateAddress where `url`'s host resolves to any address that is not public."""
    parts = urllib.parse.urlsplit(url)
    if not parts.hostname:
        raise OSError("the URL names no host")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    for *_, sockaddr in _resolve(parts.hostname, port):
        if not public(sockaddr[0]):
            raise PrivateAddress(
                f"{parts.hostname} is at {sockaddr[0]}, not a public address "
                "(start the gateway with --allow-private-image-urls to fetch from it)"
            )


def _public_connection(address, timeout=socket._GLOBAL_DEFAULT_TIMEOUT, source_address=None):
    """socket.create_connection to a public address of `address`'s host, never another."""
    host, port = address
    infos = _resolve(host, port)
    for *_, sockaddr in infos:
        if not public(sockaddr[0]):
            raise PrivateAddress(f"{host} is at {sockaddr[0]}, not a public address")
    return socket.create_connection((infos[0][4][0], port), timeout, source_address)


class _PublicHTTPConnection(http.client.HTTPConnection):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._create_connection = _public_connection


class _PublicHTTPSConnection(http.client.HTTPSConnection):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._create_connection = _public_connection


def _direct(request: urllib.request.Request) -> bool:
    """Whether the request goes straight to its host (no proxy between)."""
    return not request.has_proxy() and getattr(request, "_tunnel_host", None) is None


class _PublicHTTPHandler(urllib.request.HTTPHandler):
    def http_open(self, request):
        return self.do_open(
            _PublicHTTPConnection if _direct(request) else http.client.HTTPConnection, request
        )


class _PublicHTTPSHandler(urllib.request.HTTPSHandler):
    def https_open(self, request):
        connection = _PublicHTTPSConnection if _direct(request) else http.client.HTTPSConnection
        return self.do_open(connection, request, context=self._context)


class _HttpRedirects(urllib.request.HTTPRedirectHandler):
    """At most MAX_REDIRECTS redirects, each to http(s) only (urllib would also follow ftp), and
    to a public host unless private ones are allowed."""

    max_redirections = MAX_REDIRECTS

    def __init__(self, allow_private: bool):
        super().__init__()
        self.allow_private = allow_private

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if scheme(newurl) not in URL_SCHEMES:
            raise urllib.error.URLError(f"redirected to a {scheme(newurl) or 'relative'} URL, not http(s)")
        if not self.allow_private:
            check_host(newurl)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _opener(allow_private: bool) -> urllib.request.OpenerDirector:
    """urllib with http(s) and nothing else: no file:, ftp: or data: handlers."""
    opener = urllib.request.OpenerDirector()
    plain = (urllib.request.HTTPHandler(), urllib.request.HTTPSHandler())
    for handler in (
        urllib.request.ProxyHandler(),  # the environment's proxies, as other HTTP clients honour them
        *(plain if allow_private else (_PublicHTTPHandler(), _PublicHTTPSHandler())),
        _HttpRedirects(allow_private),
        urllib.request.HTTPDefaultErrorHandler(),
        urllib.request.HTTPErrorProcessor(),
    ):
        opener.add_handler(handler)
    return opener


def scheme(url: str) -> str:
    return url.split(":", 1)[0].lower() if ":" in url else ""


def download(url: str, field: str, max_bytes: int, allow_private: bool = False) -> tuple[bytes, str]:
    """An http(s) URL's body, at most `max_bytes`, and its media type where it is an image's
    ("" otherwise: core reads the type from the bytes). Runs in a thread."""
    deadline = time.monotonic() + FETCH_TIMEOUT_S
    request = urllib.request.Request(url, headers={"Accept": ", ".join(MEDIA_TYPES)})
    try:
        if not allow_private:
            check_host(url)
        # the scheme is http(s): checked by the caller, and by _HttpRedirects on every redirect
        with _opener(allow_private).open(request, timeout=FETCH_TIMEOUT_S) as response:
            length = response.headers.get("Content-Length", "")
            if length.isdigit() and int(length) > max_bytes:
                raise ImageError(field, f"the image is {length} bytes, more than the cap of {max_bytes}")
            body = bytearray()
            while chunk := response.read(READ_CHUNK_BYTES):
                body += chunk
                if len(body) > max_bytes:
                    raise ImageError(field, f"the image is more than the cap of {max_bytes} bytes")
                if time.monotonic() > deadline:
                    raise ImageError(field, f"fetching the image took more than {FETCH_TIMEOUT_S:g} s")
            media_type = response.headers.get_content_type()
    except ImageError:
        raise
    except urllib.error.HTTPError as error:
        reason = (
            f"more than {MAX_REDIRECTS} redirects, or a redirect loop"
            if 300 <= error.code < 400
            else f"HTTP {error.code} {error.reason}"
        )
        raise ImageError(field, f"fetching the image failed: {reason}") from None
    except urllib.error.URLError as error:
        raise ImageError(field, f"fetching the image failed: {error.reason}") from None
    except (OSError, http.client.HTTPException, ValueError) as error:  # timeouts, resets, bad answers
        raise ImageError(field, f"fetching the image failed: {error or type(error).__name__}") from None
    return bytes(body), media_type if media_type in MEDIA_TYPES else ""
