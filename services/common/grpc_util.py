"""gRPC plumbing every service shares: addresses, message caps, health, shutdown.

Addresses are `unix:/path/to.sock` (same host; ~2x faster round trips than
loopback TCP) or `host:port`. Every server and channel sets explicit message size
caps instead of gRPC's defaults or "unlimited". With `TlsFiles` given, servers
require mTLS and channels present a client certificate. A server refuses to bind a
non-loopback address without TLS, since anyone on the network could then drive it,
unless told `insecure` (`--insecure`), and then it says so in its log.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.logging import get_logger
from services.common.malformed_requests import RejectMalformedRequests
from services.common.tls import TlsError, TlsFiles, channel_credentials, reloadable_server_credentials
from services.common.unix_sockets import claim_socket_path

log = get_logger(__name__)
DEFAULT_MAX_MESSAGE_BYTES = 512 * 1024 * 1024
DEFAULT_GRACE_S = 10.0
# Core starts the details of an UNAVAILABLE it sends itself with this (a worker or layer is
# missing, the model is loading): the gateway shows those details, where a broken channel to
# core gets a generic message.
CORE_NOT_SERVING = "core is not serving: "


def not_serving_details(message: str) -> str:
    return message if message.startswith(CORE_NOT_SERVING) else CORE_NOT_SERVING + message


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Reconnect quickly after a worker restarts instead of gRPC's 1 s..120 s backoff.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2000),
        ("grpc.min_reconnect_backoff_ms", 100),
    ]


def server_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]


def normalize_address(address: str) -> str:
    """Accept `unix:/p`, `unix:///p`, a bare socket path ending in .sock, or host:port."""
    if address.startswith("unix://"):
        return "unix:" + address[len("unix://") :]
    if address.startswith("unix:"):
        return address
    if address.endswith(".sock") or address.startswith("/"):
        return "unix:" + str(Path(address).absolute())
    return address


def unix_socket_path(address: str) -> Path | None:
    address = normalize_address(address)
    return Path(address[len("unix:") :]) if address.startswith("unix:") else None


def is_loopback(address: str) -> bool:
    """unix sockets, localhost and loopback IPs; anything else is reachable from other hosts."""
    if address.startswith("unix:") or address.startswith("/"):
        return True
    host = address.rsplit(":", 1)[0].strip("[]")
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_loopback_address(address: str) -> bool:
    return is_loopback(normalize_address(address))


def aio_channel(
    address: str, tls: TlsFiles | None = None, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
) -> grpc.aio.Channel:
    """A grpc.aio channel to `address`, mTLS when `tls` is given (create it inside its loop)."""
    options = channel_options(max_message_bytes)
    address = normalize_address(address)
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    if unix_socket_path(address) is not None:
        # gRPC would check the certificate against the socket path; certificates name localhost.
        options += [("grpc.ssl_target_name_override", "localhost"), ("grpc.default_authority", "localhost")]
    return grpc.aio.secure_channel(address, channel_credentials(tls), options=options)


class InsecureBindRefused(ValueError):
    """A non-loopback address without TLS, and no --insecure."""


def refuse_insecure_bind(address: str, tls: TlsFiles | None, insecure: bool) -> bool:
    """Raise InsecureBindRefused where `address` is reachable from other hosts, TLS is off and
    `insecure` was not given; True where it was (the bind is then open to the network)."""
    if tls is not None or is_loopback_address(address):
        return False
    if not insecure:
        raise InsecureBindRefused(
            f"refusing to listen on {address} without TLS: anyone on the network could drive this "
            "service. Add [tls] to cluster.toml (moe-mesh certs) or --tls-dir, listen on loopback or "
            "a unix: socket, or pass --insecure on a network you trust"
        )
    return True


def reload_on_sighup(tls: TlsFiles, reload: Callable[[], None]) -> None:
    """SIGHUP re-reads the server certificate (`moe-mesh certs --rotate`, then `kill -HUP`): new
    handshakes get it, open connections and their streams carry on. Where this thread cannot take
    signals (a server started off the main thread, as tests do), reload stays a function only."""

    def on_sighup() -> None:
        try:
            reload()
        except TlsError as error:
            log.error("tls_reload_failed", cert=str(tls.cert), error=str(error))
        else:
            log.info("tls_reloaded", cert=str(tls.cert))

    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, on_sighup)
    except (RuntimeError, ValueError, NotImplementedError):
        log.debug("tls_reload_on_sighup_off", reason="not the main thread's event loop")


def bind(server: grpc.aio.Server, address: str, tls: TlsFiles | None = None, insecure: bool = False) -> str:
    address = normalize_address(address)
    if refuse_insecure_bind(address, tls, insecure):
        log.warning(
            "insecure_bind", address=address, hint="reachable from other hosts without TLS (--insecure)"
        )
    path = unix_socket_path(address)
    if path is not None:
        claim_socket_path(path)
    try:
        if tls is not None:
            credentials, reload = reloadable_server_credentials(tls)
            port = server.add_secure_port(address, credentials)
            reload_on_sighup(tls, reload)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError as error:  # grpcio raises for a port in use or an address it cannot parse
        raise OSError(
            f"cannot listen on {address}: in use, or not a host:port / unix:PATH address"
        ) from error
    if path is None and port == 0:
        raise OSError(f"cannot listen on {address}: in use, or not a host:port / unix:PATH address")
    return address


def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str]) -> health.HealthServicer:
    health_servicer = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [
        *service_names,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    ]
    reflection.enable_server_reflection(names, server)
    return health_servicer


async def set_serving(health_servicer, services: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *services]:
        result = health_servicer.set(name, status)
        if asyncio.iscoroutine(result):
            await result


@dataclass
class RunningServer:
    server: grpc.aio.Server
    address: str
    health: object
    service_name: str

    async def set_serving(self, serving: bool) -> None:
        await set_serving(self.health, [self.service_name], serving)

    async def serve_until_signal(
        self,
        on_stop: Callable[[], Awaitable[None]] | None = None,
        grace_s: float = DEFAULT_GRACE_S,
        drain_delay_s: float = 0.0,
    ) -> None:
        """Serve until SIGTERM/SIGINT, then drain: health goes NOT_SERVING first and stays
        observable for `drain_delay_s` while the server still answers (so health checkers and
        clients move away before connections are refused), then new RPCs are refused while
        in-flight ones get up to `grace_s` to finish, and only then `on_stop` runs (core stops
        its engine there)."""

        async def draining() -> None:
            log.info("draining", address=self.address, grace_s=grace_s, drain_s=drain_delay_s)
            await self.set_serving(False)
            if drain_delay_s > 0:
                await asyncio.sleep(drain_delay_s)

        await run_until_signal(
            self.server,
            draining,
            grace_s=grace_s,
            socket_path=unix_socket_path(self.address),
            after_stop=on_stop,
        )


async def start_server(
    add_servicer: Callable[[grpc.aio.Server], None],
    service_name: str,
    listen: str,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    serving: bool = True,
    tls: TlsFiles | None = None,
    insecure: bool = False,
) -> RunningServer:
    """A started grpc.aio server with our servicer, health (starting at `serving`) and reflection;
    mTLS-only when `tls` is given; beyond loopback without TLS only when `insecure`."""
    # bytes that do not parse get INVALID_ARGUMENT, not grpcio's UNKNOWN
    server = grpc.aio.server(
        options=server_options(max_message_bytes), interceptors=[RejectMalformedRequests()]
    )
    add_servicer(server)
    health_servicer = add_health_and_reflection(server, [service_name])
    address = bind(server, listen, tls, insecure)
    await server.start()
    running = RunningServer(server, address, health_servicer, service_name)
    await running.set_serving(serving)
    return running


async def run_until_signal(
    server: grpc.aio.Server,
    on_stop: Callable[[], Awaitable[None]] | None = None,
    grace_s: float = DEFAULT_GRACE_S,
    socket_path: Path | None = None,
    after_stop: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT; then `on_stop`, a graceful stop (in-flight RPCs get `grace_s`),
    `after_stop`, and the Unix socket is removed."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        if on_stop is not None:
            await on_stop()
        await server.stop(grace_s)
        if after_stop is not None:
            await after_stop()
        if socket_path is not None and socket_path.exists():
            try:
                os.unlink(socket_path)
            except OSError:
                pass


async def check_health(
    target: str, service: str = "", timeout_s: float = 2.0, tls: TlsFiles | None = None
) -> bool:
    async with aio_channel(target, tls) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.aio.AioRpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def install_uvloop() -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency everywhere but Windows
        pass


def start_metrics_server(listen: str | None) -> None:
    """Serve prometheus_client's default registry over HTTP at `host:port` (or a bare port on
    loopback); None = no endpoint. Metrics name workers and layers, hence loopback by default."""
    if not listen:
        return
    from prometheus_client import start_http_server

    host, port = ("127.0.0.1", listen) if ":" not in listen else listen.rsplit(":", 1)
    start_http_server(int(port), addr=host.strip("[]"))
    log.info("metrics_listening", address=f"{host}:{port}")
