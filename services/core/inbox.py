"""What other threads hand the engine thread: requests to add, cancels, and None to stop.

A burst of requests reaches an idle core one by one: the servicer renders and tokenizes each
in turn, so sixteen clients that send together arrive over some milliseconds. Stepping at the
first arrival prefills the burst in uneven groups, each step a new batch shape, and the last
request's first token waits for all of them. From idle, the inbox therefore keeps taking
arrivals while they come less than `gather_gap_s` apart (at most `GATHER_WINDOWS` gaps in
all, and no more than one step can prefill), so a burst shares one prefill step. A lone
request pays one gap; 0 turns gathering off.
"""

from __future__ import annotations

import queue
import time

# how long, in gaps, a burst may keep gathering: arrivals that never pause must still start
GATHER_WINDOWS = 10


class EngineInbox:
    def __init__(self, gather_gap_s: float = 0.0, max_tokens: int = 512, max_sequences: int = 16):
        """max_tokens, max_sequences: what one step prefills; a burst that fills it stops gathering."""
        if gather_gap_s < 0:
            raise ValueError("the burst gather gap must not be negative")
        self.gather_gap_s = gather_gap_s
        self.max_tokens = max_tokens
        self.max_sequences = max_sequences
        self._queue: queue.Queue = queue.Queue()

    def put(self, item) -> None:
        """("add" | "cancel", sequence), or None to stop the engine thread. Thread-safe."""
        self._queue.put(item)

    def take(self, timeout: float, gather: bool = False) -> list | None:
        """Everything that has arrived, in order, waiting up to `timeout` seconds for the first
        item (0: no wait; an empty list when none came). With `gather` and a request first, also
        the requests of its burst (the module docstring says which). None once asked to stop."""
        try:
            first = self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
        except queue.Empty:
            return []
        if first is None:
            return None
        items, item = [], first
        gathering = gather and self.gather_gap_s > 0 and first[0] == "add"
        deadline = time.monotonic() + self.gather_gap_s * GATHER_WINDOWS if gathering else 0.0
        sequences = tokens = 0
        while item is not None:
            items.append(item)
            if item[0] == "add":
                sequences, tokens = sequences + 1, tokens + len(item[1].request.prompt)
            full = sequences >= self.max_sequences or tokens >= self.max_tokens
            # what has arrived is always taken; a burst not yet full waits up to a gap for more
            wait = min(self.gather_gap_s, deadline - time.monotonic()) if gathering and not full else 0.0
            try:
                item = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
            except queue.Empty:
                return items  # nothing more, or the burst paused: it is all here
        return None
