"""Frames: protobuf messages on a byte stream, for the same-host expert data path.

A frame is a 4-byte little-endian length, then that many bytes of one serialized message
(ExpertCall from core, ExpertResult back). gRPC stays the control plane and the path
between hosts; on one host a plain Unix socket round trip costs ~45 us idle and ~100 us
right after a worker's compute, where a gRPC stream costs ~220 and ~350 us
(bench/socket_floor.py, bench/grpc_echo.py).
"""

from __future__ import annotations

import struct

HEADER = struct.Struct("<I")


class FrameError(ConnectionError):
    """The stream broke, timed out (`timed_out`) or carried something that is not a frame."""

    timed_out = False


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
