"""Fixtures: a Core double on a Unix socket and the real gateway app under uvicorn + uvloop.

Both run in background threads with their own event loops, the way they run in production
(separate processes talking gRPC), so the tests exercise the real HTTP, SSE and gRPC paths.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from services.gateway.app import create_app
from services.gateway.server import uvicorn_config

from .core_double import CoreDouble, CoreDoubleServer


class GatewayThread:
    """The gateway app served by uvicorn on a free loopback port, in a daemon thread."""

    def __init__(self, core_target: str, max_connections: int | None = None, **app_options: object) -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))  # bound here, so the port cannot be taken meanwhile
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        config = uvicorn_config(
            create_app(core_target, **app_options),  # type: ignore[arg-type]
            **({} if max_connections is None else {"max_connections": max_connections}),
            log_level="warning",
            lifespan="on",
        )
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._socket]}, name="gateway", daemon=True
        )

    def start(self) -> GatewayThread:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("gateway did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(10)
        self._socket.close()


@pytest.fixture(scope="session")
def core_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoreDoubleServer]:
    socket_path = tmp_path_factory.mktemp("core") / "core.sock"
    server = CoreDoubleServer(f"unix://{socket_path}").start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def gateway(core_server: CoreDoubleServer) -> Iterator[GatewayThread]:
    thread = GatewayThread(core_server.target, model_name_hint="tiny-moe").start()
    yield thread
    thread.stop()


@pytest.fixture
def core(core_server: CoreDoubleServer) -> Iterator[CoreDouble]:
    """The double, reset before and after each test so scripts never leak between tests."""
    core_server.double.reset()
    core_server.set_serving(True)
    yield core_server.double
    core_server.double.reset()


@pytest.fixture
def gateway_url(gateway: GatewayThread, core: CoreDouble) -> str:
    return gateway.url
