"""How many requests core holds: at most `max_num_seqs` running and `max_queue` waiting.

A request counts from `admit` (the servicer's thread) until its sequence is released (the
engine thread), once, however many ways it ends.
"""

from __future__ import annotations

import threading

from services.core.sequence import Sequence


class Overloaded(Exception):
    pass


class Admission:
    def __init__(self, max_running: int, max_waiting: int):
        self._max_running, self._max_waiting = max_running, max_waiting
        self._lock = threading.Lock()
        self.count = 0  # admitted and not yet released

    def admit(self) -> None:
        """Count one more request, or raise Overloaded when core holds all it may."""
        with self._lock:
            if self.count >= self._max_running + self._max_waiting:
                raise Overloaded(
                    f"core is at capacity: {self._max_running} running and {self._max_waiting} waiting"
                )
            self.count += 1

    def release(self, sequence: Sequence) -> None:
        """The sequence is done; the first release of it frees its place."""
        if sequence.done:
            return
        sequence.done = True
        with self._lock:
            self.count -= 1
