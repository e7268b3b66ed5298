"""A TCP relay that delays every byte by a fixed time each way: link latency without tc netem.

    python bench/delay_relay.py --listen 127.0.0.1:6001 --target 10.77.0.2:50061 --delay-ms 1

Used by bench/cluster.py where the kernel lacks sch_netem (containers often do). Bytes keep
their order; each chunk read at time t is written at t + delay, so throughput is not capped
by the delay (like a long pipe, not like stop-and-wait). The relay's own cost (Python, two
extra socket hops) is measured separately by running it with --delay-ms 0.

With --initial-delay-ms the relay starts at that delay; SIGUSR1 switches it to --delay-ms and
SIGUSR2 back (bench/soak_link.py delays a live link this way, connections kept open).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal


class Delay:
    """The relay's delay in seconds, read for every chunk: it may change while connections run."""

    def __init__(self, seconds: float):
        self.seconds = seconds


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: Delay) -> None:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    async def send() -> None:
        while (item := await queue.get()) is not None:
            due, data = item
            if (wait := due - loop.time()) > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        writer.close()

    sender = asyncio.create_task(send())
    try:
        while data := await reader.read(1 << 20):
            queue.put_nowait((loop.time() + delay.seconds, data))
    except ConnectionError:
        pass
    finally:
        queue.put_nowait(None)
        with contextlib.suppress(ConnectionError):
            await sender


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--listen", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--delay-ms", type=float, default=1.0)
    parser.add_argument(
        "--initial-delay-ms", type=float, default=None, help="until SIGUSR1 (default: --delay-ms)"
    )
    args = parser.parse_args()
    delayed = args.delay_ms / 1000
    delay = Delay(delayed if args.initial_delay_ms is None else args.initial_delay_ms / 1000)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, lambda: setattr(delay, "seconds", delayed))
    loop.add_signal_handler(signal.SIGUSR2, lambda: setattr(delay, "seconds", 0.0))
    target_host, target_port = args.target.rsplit(":", 1)

    async def handle(client_reader, client_writer) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(target_host, int(target_port))
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(
            pipe(client_reader, server_writer, delay), pipe(server_reader, client_writer, delay)
        )

    host, port = args.listen.rsplit(":", 1)
    server = await asyncio.start_server(handle, host, int(port))
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main())
