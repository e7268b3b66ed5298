"""A step's chunks reach their request queues at the end of the step, in order, one wake-up per
event loop; outside a step (a request refused on arrival) they go at once."""

from __future__ import annotations

import asyncio
import threading

from services.core.sequence import Outbox


class CountingLoop:
    """An event loop that counts the wake-ups (`call_soon_threadsafe`) other threads make."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.wakeups = loop, 0

    def call_soon_threadsafe(self, callback, *args):
        self.wakeups += 1
        return self.loop.call_soon_threadsafe(callback, *args)


def test_a_steps_chunks_arrive_in_order_after_one_wakeup():
    async def main():
        loop = CountingLoop(asyncio.get_running_loop())
        first, second = asyncio.Queue(), asyncio.Queue()
        outbox = Outbox()

        def engine_step():
            outbox.holding = True
            for token in range(3):
                outbox.put(loop, first, ("a", token))
                outbox.put(loop, second, ("b", token))
            assert first.empty() and second.empty() and loop.wakeups == 0  # held
            outbox.flush()

        thread = threading.Thread(target=engine_step)
        thread.start()
        thread.join()
        got_first = [await asyncio.wait_for(first.get(), 1) for _ in range(3)]
        got_second = [await asyncio.wait_for(second.get(), 1) for _ in range(3)]
        assert got_first == [("a", t) for t in range(3)]
        assert got_second == [("b", t) for t in range(3)]
        assert loop.wakeups == 1

        outbox.put(loop, first, "refused")  # not in a step: at once
        assert await asyncio.wait_for(first.get(), 1) == "refused"
        assert loop.wakeups == 2

    asyncio.run(main())


def test_a_closed_loop_does_not_stop_the_others():
    closed = asyncio.new_event_loop()
    closed.close()

    async def main():
        live = asyncio.get_running_loop()
        out = asyncio.Queue()
        outbox = Outbox()
        outbox.holding = True
        outbox.put(closed, asyncio.Queue(), "lost")
        outbox.put(live, out, "kept")
        outbox.flush()
        assert await asyncio.wait_for(out.get(), 1) == "kept"

    asyncio.run(main())
