"""`FrameLink`: core's blocking connection to one worker's frame socket (same host).

Used from the engine thread only, one call at a time: send every part's frame, then read
the answers, with a deadline. No event loop hop and no gRPC machinery on the way, which is
what a one-token decode step's layer call is mostly made of on a small CPU. Any I/O
trouble closes the connection and raises FrameError; the next call reconnects.
"""

from __future__ import annotations

import socket
import time

from google.protobuf.message import DecodeError

from services.common.frames import (
    HEADER,
    FrameError,
    enlarge_send_buffer,
    frame,
    frame_length,
    receive_exact,
)
from services.proto.moemesh.v1 import expert_pb2

MAX_FAILED_CONNECTS = 3  # then the link is left to gRPC until the worker is described again


class FrameLink:
    """spin_s: how long a read polls before it sleeps (services.common.frames.receive_exact)."""

    def __init__(self, path: str, max_frame_bytes: int, spin_s: float = 0.0):
        self.path = path
        self.max_frame_bytes = max_frame_bytes
        self.spin_s = spin_s
        self._socket: socket.socket | None = None
        self.failed_connects = 0

    @property
    def usable(self) -> bool:
        """False once connecting failed again and again (a socket path core cannot reach, e.g.
        another container's): calls then go straight to gRPC instead of failing over each time."""
        return self.failed_connects < MAX_FAILED_CONNECTS

    def room(self) -> int:
        """Bytes the connection's send buffer takes while the worker reads nothing (0: not connected)."""
        if self._socket is None:
            return 0
        return self._socket.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)

    def send(self, call: expert_pb2.ExpertCall, deadline: float) -> None:
        try:
            sock = self._connected(deadline)
            sock.settimeout(_remaining(deadline))
            sock.sendall(frame(call.SerializeToString()))
        except OSError as error:
            raise self._broken(error) from None

    def receive(self, deadline: float) -> expert_pb2.ExpertResult:
        try:
            size = frame_length(self._read(HEADER.size, deadline), self.max_frame_bytes)
            return expert_pb2.ExpertResult.FromString(self._read(size, deadline))
        except (OSError, DecodeError) as error:
            raise self._broken(error) from None

    def _broken(self, error: Exception) -> FrameError:
        """Close (a half-read stream is out of step for good) and say what happened."""
        self.close()
        if isinstance(error, FrameError):
            return error
        broken = FrameError(f"{self.path}: {error or type(error).__name__}")
        broken.timed_out = isinstance(error, TimeoutError)
        return broken

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def _connected(self, deadline: float) -> socket.socket:
        if self._socket is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(_remaining(deadline))
            try:
                sock.connect(self.path)
            except OSError:
                sock.close()
                self.failed_connects += 1
                raise
            self.failed_connects = 0
            enlarge_send_buffer(sock)
            self._socket = sock
        return self._socket

    def _read(self, size: int, deadline: float) -> bytearray:
        sock = self._socket
        if sock is None:
            raise FrameError(f"{self.path}: not connected")
        try:
            return receive_exact(sock, size, spin_s=self.spin_s, deadline=deadline)
        except FrameError as error:
            raise FrameError(f"{self.path}: {error}") from None


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left
