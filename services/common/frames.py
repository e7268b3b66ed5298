"""Frames: protobuf messages on a byte stream, for the same-host expert data path.

A frame is a 4-byte little-endian length, then that many bytes of one serialized message
(ExpertCall from core, ExpertResult back). gRPC stays the control plane and the path
between hosts; on one host a plain Unix socket round trip costs ~45 us idle and ~100 us
right after a worker's compute, where a gRPC stream costs ~220 and ~350 us
(bench/socket_floor.py, bench/grpc_echo.py).
"""

from __future__ import annotations

import os
import socket
import struct
import time

HEADER = struct.Struct("<I")
SPIN_S = 0.01  # a layer call's gap is a few ms on a CPU, far less on a GPU


def spin_for(processes: int, cores: int | None = None) -> float:
    """How long frame reads poll before sleeping when `processes` of ours (core and the
    same-host workers) share this machine: SPIN_S when each has a core of its own, else 0
    (pollers that outnumber the cores steal them from the compute: on 2 cores, core plus two
    polling workers decode at half speed)."""
    cores = cores or os.cpu_count() or 1
    return SPIN_S if cores >= processes else 0.0


def add_spin_flag(parser) -> None:
    parser.add_argument(
        "--frame-spin-us",
        type=int,
        default=None,
        help="microseconds a frame-socket read polls before it sleeps (default: 10000 on machines "
        "with 8 or more cores, else 0; `moe-mesh up` sets it from its process count)",
    )


def spin_seconds(flag_us: int | None) -> float:
    if flag_us is None:
        return spin_for(8)
    if flag_us < 0:
        raise SystemExit(f"--frame-spin-us must be >= 0, got {flag_us}")
    return flag_us / 1e6


# Asked of each frame connection so that a decode call, or its answer, fits whole in the send
# buffer while the other side is busy (ping-pong micro-batches); the system may grant less.
SEND_BUFFER_BYTES = 1 << 20


def enlarge_send_buffer(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
    except OSError:
        pass  # the system's limit stands


class FrameError(ConnectionError):
    """The stream broke, timed out (`timed_out`) or carried something that is not a frame."""

    timed_out = False


FIRST_ALLOCATION = 1 << 20


def frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


def frame_length(header: bytes, max_bytes: int) -> int:
    (size,) = HEADER.unpack(header)
    if size > max_bytes:
        raise FrameError(f"frame of {size} bytes is over the {max_bytes}-byte cap")
    return size


def frames_path_for(socket_path: str) -> str:
    """Where a worker listening on the Unix socket `socket_path` serves frames."""
    return socket_path + ".frames"


def receive_exact(
    sock: socket.socket,
    size: int,
    *,
    spin_s: float = 0.0,
    deadline: float | None = None,
    eof_ok: bool = False,
    grow: bool = False,
) -> bytearray | None:
    """`size` bytes from a blocking socket (None at a clean end of stream when `eof_ok`).

    spin_s: first poll without blocking for up to that long. A thread that sleeps in recv
    wakes ~100 us after its answer arrives on a small VM (and its core cools down); one that
    polls sees it at once. Worth it only where the poller has a core to itself, which is why
    it is a setting (`moe-mesh up` turns it on when the machine has a core per process).
    deadline: time.monotonic() after which TimeoutError is raised (the socket keeps the timeout
    it was last given: a caller that then waits without one sets it back); None waits for ever."""
    # grow: the buffer grows as bytes arrive (doubling from 1 MiB), so a header that announces a
    # large frame and then stalls holds no more memory than what was really sent. For a peer that
    # is not trusted (the worker's side); core reads its workers' replies into one allocation.
    buffer = bytearray(min(size, FIRST_ALLOCATION) if grow else size)
    view, got = memoryview(buffer), 0
    if spin_s > 0 and size:
        got = _poll_into(sock, view, spin_s if deadline is None else min(spin_s, deadline - time.monotonic()))
    try:
        while got < size:
            if got == len(buffer):
                view.release()
                buffer.extend(bytes(min(len(buffer), size - len(buffer))))
                view = memoryview(buffer)
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("deadline passed")
                sock.settimeout(left)
            n = sock.recv_into(view[got:])
            if n == 0:
                if eof_ok and got == 0:
                    return None
                raise FrameError("the connection closed inside a frame" if got else "the connection closed")
            got += n
    finally:
        view.release()
    return buffer  # protobuf parses bytes-like objects: no copy


def _poll_into(sock: socket.socket, view: memoryview, spin_s: float) -> int:
    """Bytes read into `view` by polling for up to spin_s; the socket is left blocking."""
    got, limit = 0, time.perf_counter() + spin_s
    sock.setblocking(False)
    try:
        while got < len(view):
            try:
                n = sock.recv_into(view[got:])
            except BlockingIOError:
                if time.perf_counter() > limit:
                    break
                continue
            if n == 0:
                break  # end of stream: the blocking read reports it
            got += n
    finally:
        sock.setblocking(True)
    return got
