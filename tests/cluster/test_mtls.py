"""mTLS on peer links with `moe-mesh certs` output: the right certificate gets in; no certificate,
a certificate from another CA, or plaintext are refused at the handshake; a server with a
certificate from another CA is refused by the client; binding beyond loopback without TLS is refused
unless --insecure; rotated certificates load on SIGHUP without dropping streams."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_util import aio_channel, start_server
from services.common.tls import TlsFiles, channel_credentials, issue_certificate
from services.gateway.core_client import CoreClient, CoreClientConfig
from services.ops.cli import main
from tests.helpers import free_port


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    cluster, other = root / "cluster", root / "other"
    main(["certs", "--out", str(cluster), "--name", "core"])  # the CLI, in-process
    issue_certificate(cluster, "gateway", [])
    issue_certificate(other, "gateway", [])  # same name, another CA
    issue_certificate(other, "core", [])
    assert (cluster / "core-key.pem").stat().st_mode & 0o077 == 0  # private keys are 0600
    return cluster, other


async def _health(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode | int:
    if credentials is None:
        channel = grpc.aio.insecure_channel(address)
    else:
        channel = grpc.aio.secure_channel(address, credentials)
    async with channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=3
            )
        except grpc.aio.AioRpcError as error:
            return error.code()
    return reply.status


async def test_only_clients_with_a_certificate_from_the_cluster_ca_get_in(pki):
    cluster, other = pki
    address = f"127.0.0.1:{free_port()}"
    running = await start_server(
        lambda server: None, "test.Service", address, tls=TlsFiles.in_dir(cluster, "core")
    )
    try:
        ok = await _health(address, channel_credentials(TlsFiles.in_dir(cluster, "gateway")))
        assert ok == health_pb2.HealthCheckResponse.SERVING
        ca_only = grpc.ssl_channel_credentials(root_certificates=(cluster / "ca.pem").read_bytes())
        assert await _health(address, ca_only) == grpc.StatusCode.UNAVAILABLE  # no client certificate
        foreign = grpc.ssl_channel_credentials(
            root_certificates=(cluster / "ca.pem").read_bytes(),
            private_key=(other / "gateway-key.pem").read_bytes(),
            certificate_chain=(other / "gateway.pem").read_bytes(),
        )
        assert await _health(address, foreign) == grpc.StatusCode.UNAVAILABLE  # another CA's certificate
        assert await _health(address, None) == grpc.StatusCode.UNAVAILABLE  # plaintext
    finally:
        await running.server.stop(0)


async def test_client_refuses_a_server_certified_by_another_ca(pki):
    cluster, other = pki
    address = f"127.0.0.1:{free_port()}"
    running = await start_server(
        lambda server: None, "test.Service", address, tls=TlsFiles.in_dir(other, "core")
    )
    try:
        refused = await _health(address, channel_credentials(TlsFiles.in_dir(cluster, "gateway")))
        assert refused == grpc.StatusCode.UNAVAILABLE
    finally:
        await running.server.stop(0)


async def test_gateway_reaches_core_over_mtls_on_a_unix_socket(pki, short_tmp):
    cluster, _ = pki
    address = f"unix:{short_tmp / 'core.sock'}"
    running = await start_server(
        lambda server: None, "moemesh.v1.Core", address, tls=TlsFiles.in_dir(cluster, "core")
    )
    try:
        with_cert = CoreClient(
            CoreClientConfig(address, unary_timeout_s=3, tls=TlsFiles.in_dir(cluster, "gateway"))
        )
        without = CoreClient(CoreClientConfig(address, unary_timeout_s=3))
        assert await with_cert.health() == "SERVING"
        assert await without.health() == "UNREACHABLE"
        await with_cert.close()
        await without.close()
    finally:
        await running.server.stop(0)


async def test_binding_beyond_loopback_without_tls_is_refused_unless_insecure(pki, monkeypatch):
    from services.common import grpc_util

    warnings = []
    # A stand-in for the module's logger: structlog loggers cached by earlier tests would
    # bypass structlog.testing.capture_logs.
    monkeypatch.setattr(
        grpc_util, "log", SimpleNamespace(warning=lambda event, **kw: warnings.append((event, kw)))
    )
    cluster, _ = pki
    port = free_port()
    with pytest.raises(grpc_util.InsecureBindRefused, match="--insecure"):
        await start_server(lambda server: None, "test.Service", f"0.0.0.0:{port}")
    running = await start_server(lambda server: None, "test.Service", f"0.0.0.0:{port}", insecure=True)
    await running.server.stop(0)
    loopback = await start_server(lambda server: None, "test.Service", f"127.0.0.1:{free_port()}")
    await loopback.server.stop(0)
    secure = await start_server(
        lambda server: None, "test.Service", f"0.0.0.0:{free_port()}", tls=TlsFiles.in_dir(cluster, "core")
    )
    await secure.server.stop(0)
    assert [(event, kw["address"]) for event, kw in warnings] == [("insecure_bind", f"0.0.0.0:{port}")]


@pytest.mark.slow
@pytest.mark.parametrize("role", ["expert", "core"])
def test_a_service_asked_to_listen_on_the_network_without_tls_exits_naming_the_fix(role, tmp_path):
    """The real command, before it loads anything: one line naming --insecure and [tls]."""
    import subprocess
    import sys

    args = ["--split", str(tmp_path), "--listen", f"0.0.0.0:{free_port()}"]
    if role == "core":
        args += ["--worker", "127.0.0.1:1"]
    done = subprocess.run(
        [sys.executable, "-m", "services.ops.cli", role, *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "without TLS" in done.stderr and "--insecure" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr


async def test_missing_tls_files_are_named(tmp_path):
    from services.common.tls import TlsError

    with pytest.raises(TlsError, match="ca.pem"):
        async with aio_channel("127.0.0.1:1", TlsFiles.in_dir(tmp_path, "core")):
            pass


def test_certs_refuses_to_replace_a_ca_whose_key_is_elsewhere(tmp_path):
    """Keeping ca-key.pem off serving hosts is the advice; issuing one more certificate there must
    not mint a new CA and silently invalidate every certificate the cluster holds."""
    main(["certs", "--out", str(tmp_path), "--name", "core"])
    ca = (tmp_path / "ca.pem").read_bytes()
    (tmp_path / "ca-key.pem").rename(tmp_path / "elsewhere.pem")
    with pytest.raises(SystemExit, match="ca-key.pem does not"):
        main(["certs", "--out", str(tmp_path), "--name", "mac-c"])
    assert (tmp_path / "ca.pem").read_bytes() == ca and not (tmp_path / "mac-c.pem").exists()


def _served_certificate_serial(port: int, cluster) -> int:
    """The serial of the certificate a new TLS handshake with the server is shown."""
    import socket
    import ssl

    from cryptography import x509

    context = ssl.create_default_context(cafile=str(cluster / "ca.pem"))
    context.load_cert_chain(cluster / "gateway.pem", cluster / "gateway-key.pem")
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname="localhost") as tls:
            return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number


async def test_rotated_certificates_load_on_sighup_and_open_streams_carry_on(tmp_path):
    """`certs --rotate` issues new leaves under the same CA; SIGHUP makes the server show its new
    one to new connections, while a stream opened before goes on receiving."""
    import asyncio
    import os
    import signal

    cluster = tmp_path / "pki"
    main(["certs", "--out", str(cluster), "--name", "core"])
    main(["certs", "--out", str(cluster), "--name", "gateway"])
    port = free_port()
    running = await start_server(
        lambda server: None, "test.Service", f"127.0.0.1:{port}", tls=TlsFiles.in_dir(cluster, "core")
    )
    try:
        before = await asyncio.to_thread(_served_certificate_serial, port, cluster)
        async with aio_channel(f"127.0.0.1:{port}", TlsFiles.in_dir(cluster, "gateway")) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            ca = (cluster / "ca.pem").read_bytes()
            main(["certs", "--out", str(cluster), "--name", "core", "--rotate"])
            assert (cluster / "ca.pem").read_bytes() == ca  # the CA stays: every peer still trusts
            os.kill(os.getpid(), signal.SIGHUP)
            await asyncio.sleep(0.2)
            after = await asyncio.to_thread(_served_certificate_serial, port, cluster)
            assert after != before
            await running.set_serving(False)  # the stream opened before the reload still delivers
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            watch.cancel()
    finally:
        await running.server.stop(0)


def test_rotate_refuses_a_folder_without_the_cluster_ca(tmp_path):
    with pytest.raises(SystemExit):
        main(["certs", "--out", str(tmp_path), "--name", "core", "--rotate"])
    assert not (tmp_path / "ca.pem").exists()
