"""The worker's frame socket: ExpertCall in, ExpertResult out, on a Unix socket beside the
gRPC one (services/common/frames.py has the format).

Each call is answered by the servicer's own `answer()`, on the event loop thread, exactly
as Forward answers it: same validation, same in-band errors, same counters. A connection
that sends something that is not a frame (an oversize length, bytes that do not parse) is
closed; the worker and its other connections carry on.
"""

from __future__ import annotations

import asyncio
import os

from google.protobuf.message import DecodeError

from services.common.frames import HEADER, FrameError, frame, frame_length
from services.common.logging import get_logger
from services.proto.moemesh.v1 import expert_pb2

log = get_logger(__name__)


async def start_frame_server(path: str, servicer, max_frame_bytes: int) -> asyncio.AbstractServer:
    async def serve_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                size = frame_length(await reader.readexactly(HEADER.size), max_frame_bytes)
                call = expert_pb2.ExpertCall.FromString(await reader.readexactly(size))
                writer.write(frame(servicer.answer(call).SerializeToString()))
                if writer.transport.get_write_buffer_size() > 1 << 20:
                    await writer.drain()
        except asyncio.IncompleteReadError:
            pass  # core closed the connection
        except (FrameError, DecodeError) as error:
            log.warning("frame_rejected", error=str(error) or type(error).__name__)
        except ConnectionError:
            pass
        finally:
            writer.close()

    if os.path.exists(path):
        os.unlink(path)  # a stale socket of a worker that did not stop cleanly
    server = await asyncio.start_unix_server(serve_connection, path)
    log.info("frames_serving", path=path)
    return server


async def stop_frame_server(server: asyncio.AbstractServer, path: str) -> None:
    server.close()
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
