"""What core keeps per image, by the hash of its pixels: least recently used first out, under a
byte budget. Request threads (processed pixels) and the engine thread (vision-tower outputs) read
and fill these, so each takes a lock."""

from __future__ import annotations

import threading
from collections import OrderedDict


class KeptByImage:
    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[str, tuple[object, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str):
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                self.misses += 1
                return None
            self.hits += 1
            self._entries.move_to_end(key)
            return found[0]

    def put(self, key: str, value, nbytes: int) -> None:
        if nbytes > self.budget_bytes:
            return
        with self._lock:
            replaced = self._entries.pop(key, None)
            if replaced is not None:
                self.nbytes -= replaced[1]
            self._entries[key] = (value, nbytes)
            self.nbytes += nbytes
            while self.nbytes > self.budget_bytes:
                _, (_, size) = self._entries.popitem(last=False)
                self.nbytes -= size

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        """Whether `key` is kept (a look that counts neither a hit nor a miss)."""
        return key in self._entries
