"""`BatchTurboQuantKVCache`: the batched form of TurboQuantKVCache for mlx-lm's batch
classes (`PromptProcessingBatch`, `GenerationBatch`).

Why rows instead of one left-padded tensor like BatchKVCache: each sequence has its
own sinks, compressed blocks and recent window, whose boundaries fall at different
positions; padding packed blocks to a common grid would waste memory and re-pack on
every merge/filter. So the batch keeps one TurboQuantKVCache per row — merge, filter,
extend and extract are list operations that share arrays — and attention runs per
row, each with its own causal mask. Right-padded prefill (`prepare(right_padding=...)`)
stores only each row's real tokens, so `finalize` has nothing to move.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import mlx.core as mx

from services.common.mlx_lm_adapter import BaseCache

if TYPE_CHECKING:
    from services.core.kv.cache import TurboQuantKVCache


class BatchTurboQuantKVCache(BaseCache):
    """Per-row TurboQuant caches behind mlx-lm's batch cache protocol.

    `offset` is an int array [B] of each row's own length (RoPE positions start at 0 in
    every row: there is no left padding). `make_mask` returns None because the
    attention hook masks each row itself."""

    def __init__(self, rows: list[TurboQuantKVCache]):
        self.rows = rows
        self._remaining: list[int] | None = None  # real tokens left per row (right-padded prefill)
        self._step_tokens: list[int] = [0] * len(rows)

    @classmethod
    def merge(cls, caches) -> BatchTurboQuantKVCache:
        for c in caches:
            if c.offset and c.state[0].shape[0] != 1:
                raise ValueError("only single-sequence TurboQuant caches can be merged into a batch")
        return cls([copy.copy(c) for c in caches])

    @property
    def offset(self) -> mx.array:
        return mx.array([r.offset for r in self.rows])

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        n = keys.shape[2]
        self._step_tokens = []
        for i, row in enumerate(self.rows):
            take = n if self._remaining is None else min(n, self._remaining[i])
            if self._remaining is not None:
                self._remaining[i] -= take
            if take:
                row.update_and_fetch(keys[i : i + 1, :, :take], values[i : i + 1, :, :take])
            self._step_tokens.append(take)
        return keys, values

    def rows_and_query_starts(self) -> list[tuple[TurboQuantKVCache, int]]:
        """Each row's cache with the position of this step's first query in it (the step
        stored `_step_tokens[i]` real tokens in row i)."""
        return [(row, row.offset - taken) for row, taken in zip(self.rows, self._step_tokens, strict=True)]

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        if left_padding is not None and max(left_padding) > 0:
            raise NotImplementedError("BatchTurboQuantKVCache stores rows unpadded; use right padding")
        if right_padding is not None and max(right_padding) > 0:
            self._remaining = list(lengths)

    def finalize(self) -> None:
        self._remaining = None

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        return None

    def filter(self, batch_indices) -> None:
        indices = batch_indices.tolist() if isinstance(batch_indices, mx.array) else list(batch_indices)
        self.rows = [self.rows[i] for i in indices]
        self._step_tokens = [0] * len(self.rows)

    def extend(self, other: BatchTurboQuantKVCache) -> None:
        self.rows = self.rows + other.rows
        self._step_tokens = [0] * len(self.rows)

    def extract(self, idx: int) -> TurboQuantKVCache:
        return copy.copy(self.rows[idx])

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        return max((row.trim(n) for row in self.rows), default=0)

    def size(self) -> int:
        return max((row.offset for row in self.rows), default=0)

    def empty(self) -> bool:
        return all(row.empty() for row in self.rows)

    @property
    def state(self) -> list[mx.array]:
        return [a for row in self.rows for a in row.state]

    @property
    def nbytes(self) -> int:
        return sum(row.nbytes for row in self.rows)

    def __deepcopy__(self, memo):
        twin = copy.copy(self)
        twin.rows = [copy.copy(r) for r in self.rows]
        twin._remaining = None if self._remaining is None else list(self._remaining)
        return twin
