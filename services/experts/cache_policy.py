"""Which cached expert to evict: pluggable policies over hashable keys.

A policy only orders keys; the store owns the memory. The store calls `touch`
on every access (hit or freshly read), `forget` when a key leaves the cache, and
`victim` to pick the key to evict, never one in `pinned` (the experts the call in
progress is about to compute with).

- `lru`: least recently used.
- `lfu-decay`: least frequently used, with the counts decaying exponentially
  (half-life in accesses) so yesterday's favourites age out. Scores are kept in
  the log domain relative to a fixed origin, so an entry's heap key never changes
  while it is not accessed and a lazy heap gives O(log n) evictions.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Hashable, Set
from typing import Protocol

POLICIES = ("lru", "lfu-decay")


class CachePolicy(Protocol):
    name: str

    def touch(self, key: Hashable) -> None: ...

    def forget(self, key: Hashable) -> None: ...

    def victim(self, pinned: Set) -> Hashable:
        """The key to evict among those touched and not forgotten, never one in `pinned`."""
        ...


class LRUPolicy:
    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def touch(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def forget(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victim(self, pinned: Set) -> Hashable:
        for key in self._order:
            if key not in pinned:
                return key
        raise LookupError("every cached expert is pinned")


class DecayedFrequencyPolicy:
    """Evict the lowest exponentially decayed access count.

    score(now) = sum over past accesses of 2^-((now - t_access) / half_life).
    Comparing log2(score) + now/half_life is time-invariant, so that is the heap key.
    """

    name = "lfu-decay"

    def __init__(self, half_life_accesses: float = 1024.0):
        if half_life_accesses <= 0:
            raise ValueError("half_life_accesses must be positive")
        self._rate = 1.0 / half_life_accesses
        self._now = 0
        self._key_of: dict[Hashable, float] = {}  # key -> current heap key (log2 score + t*rate)
        self._heap: list[tuple[float, int, Hashable]] = []
        self._tiebreak = 0

    def touch(self, key: Hashable) -> None:
        self._now += 1
        now_term = self._now * self._rate
        previous = self._key_of.get(key)
        if previous is None:
            new = now_term  # log2(1) + now*rate
        else:
            # log2(2^(prev - now_term) + 1) + now_term, computed stably.
            new = now_term + math.log2(1.0 + 2.0 ** (previous - now_term))
        self._key_of[key] = new
        self._tiebreak += 1
        heapq.heappush(self._heap, (new, self._tiebreak, key))
        if len(self._heap) > 4 * len(self._key_of) + 64:
            self._compact()

    def forget(self, key: Hashable) -> None:
        self._key_of.pop(key, None)

    def victim(self, pinned: Set) -> Hashable:
        skipped = []
        try:
            while self._heap:
                entry = heapq.heappop(self._heap)
                value, _, key = entry
                if self._key_of.get(key) != value:
                    continue  # stale: touched again or forgotten since
                if key in pinned:
                    skipped.append(entry)
                    continue
                heapq.heappush(self._heap, entry)  # stays until the store forgets it
                return key
        finally:
            for entry in skipped:
                heapq.heappush(self._heap, entry)
        raise LookupError("every cached expert is pinned")

    def _compact(self) -> None:
        self._heap = [(value, i, key) for i, (key, value) in enumerate(self._key_of.items())]
        heapq.heapify(self._heap)
        self._tiebreak = len(self._heap)


def make_policy(name: str, capacity: int = 1024) -> CachePolicy:
    if name == "lru":
        return LRUPolicy()
    if name == "lfu-decay":
        return DecayedFrequencyPolicy(half_life_accesses=max(64.0, 2.0 * capacity))
    raise ValueError(f"cache policy {name!r}: choose one of {', '.join(POLICIES)}")
