"""The worker's frame socket: ExpertCall in, ExpertResult out, on a Unix socket beside the
gRPC one (services/common/frames.py has the format).

One thread per connection (core holds one per worker), blocking on its socket: a call is
read, answered by the servicer's own `answer()` (same validation, in-band errors and
counters as Forward) and written back without an event-loop hop. Why threads and not the
event loop: a thread blocked in recv wakes straight into its work, where a loop callback
goes through the selector and a future first, and only a thread can poll its socket before
it sleeps (`spin_s`, which bench/split_ab.py --compare spin measures).

A connection that sends something that is not a frame (an oversize length, bytes that do
not parse) is closed; the worker and its other connections carry on.
"""

from __future__ import annotations

import os
import socket
import threading
import time

from google.protobuf.message import DecodeError

from services.common.frames import HEADER, FrameError, enlarge_send_buffer, frame, frame_length, receive_exact
from services.common.logging import get_logger
from services.common.mlx_threads import releasing_mlx
from services.common.unix_sockets import claim_socket_path
from services.proto.moemesh.v1 import expert_pb2

log = get_logger(__name__)

# One thread each: a core holds one connection per worker, so this is room for many cores
# (and tests) while a runaway client cannot make the worker spawn threads without end.
MAX_CONNECTIONS = 64
BODY_TIMEOUT_S = 30.0  # from a frame's header to its last byte


def read_call(
    connection: socket.socket, max_frame_bytes: int, spin_s: float = 0.0
) -> expert_pb2.ExpertCall | None:
    """The next call on `connection`, or None where the peer closed it between calls. Raises
    FrameError (not a frame, over the cap, cut short), DecodeError (not an ExpertCall) or
    TimeoutError (a body that stalls); the buffer grows only as bytes arrive."""
    header = receive_exact(connection, HEADER.size, spin_s=spin_s, eof_ok=True)
    if header is None:
        return None
    size = frame_length(header, max_frame_bytes)
    # core writes a frame at once: a body that does not follow its header is a stalled or
    # hostile peer, whose connection (and buffer) must not be kept for ever
    body = receive_exact(connection, size, deadline=time.monotonic() + BODY_TIMEOUT_S, grow=True)
    connection.settimeout(None)  # the next header may be a long idle wait away
    return expert_pb2.ExpertCall.FromString(body)


class FrameServer:
    """Serves frames on the Unix socket `path` until `close()`; `answer(call) -> result` must
    not raise for a bad call (ExpertWorkerServicer.answer answers those in-band). spin_s: how
    long a connection polls for the next call before it sleeps (frames.receive_exact)."""

    def __init__(self, path: str, answer, max_frame_bytes: int, spin_s: float = 0.0):
        self.path = path
        self.spin_s = spin_s
        self._answer = answer
        self._max_frame_bytes = max_frame_bytes
        claim_socket_path(path)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(MAX_CONNECTIONS)
        self._connections: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()  # one per connection; they compute with MLX
        self._lock = threading.Lock()
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept_loop, name="frames-accept", daemon=True)
        self._acceptor.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    connection.close()
                    return
                if len(self._connections) >= MAX_CONNECTIONS:
                    log.warning("frame_connection_refused", reason=f"{MAX_CONNECTIONS} already open")
                    connection.close()  # core then calls over gRPC
                    continue
                self._connections.add(connection)
                enlarge_send_buffer(connection)
                thread = threading.Thread(
                    target=self._run, args=(connection,), name="frames-conn", daemon=True
                )
                self._threads.add(thread)
            thread.start()

    def _run(self, connection: socket.socket) -> None:
        """A connection's thread: it leaves `_threads` only after it released MLX, so `close()`
        either joins it or finds it already released."""
        try:
            releasing_mlx(self._serve)(connection)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _serve(self, connection: socket.socket) -> None:
        try:
            while (call := read_call(connection, self._max_frame_bytes, self.spin_s)) is not None:
                connection.sendall(frame(self._answer(call).SerializeToString()))
        except (FrameError, DecodeError, TimeoutError) as error:
            log.warning("frame_rejected", error=str(error) or type(error).__name__)
        except OSError:
            pass  # the peer went away, or close() shut the connection
        except Exception:  # a bug in answering: drop this connection (core falls back to gRPC)
            log.exception("frame_connection_failed")
        finally:
            with self._lock:
                self._connections.discard(connection)
            connection.close()

    def close(self) -> None:
        """Stops accepting, ends every connection (and waits for its thread) and removes the socket file."""
        with self._lock:
            self._closed = True
            connections = list(self._connections)
        for sock in (self._listener, *connections):
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept/recv
            except OSError:
                pass
        self._listener.close()
        self._acceptor.join(timeout=2)
        with self._lock:
            threads = list(self._threads)
        for thread in threads:  # each frees its MLX state as it ends (services/common/mlx_threads.py)
            thread.join(timeout=2)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
