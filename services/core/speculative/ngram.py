"""Prompt-lookup drafting: the tokens that followed the latest earlier occurrence of the
sequence's own last n tokens (n from `max_n` down to `min_n`) are the draft; where those run into
the context's end (a short repeat: a run of one token, a repeated short phrase), the draft goes on
repeating them. It needs no model,
and it pays where an answer repeats its prompt or itself: code edits, quoting, structured output.

Each sequence keeps an index from n-gram to where it last ended with a token after it, updated
as tokens arrive, so a lookup costs O(max_n) whatever the context length."""

from __future__ import annotations


class NgramDrafter:
    def __init__(self, max_n: int = 4, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError("prompt_lookup_min must be at least 1 and at most prompt_lookup_max")
        self.max_n = max_n
        self.min_n = min_n

    def index(self) -> NgramIndex:
        return NgramIndex(self.max_n, self.min_n)


class NgramIndex:
    """One sequence's n-gram positions; `propose(context, k)` with the same, growing context."""

    def __init__(self, max_n: int, min_n: int):
        self.max_n = max_n
        self.min_n = min_n
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> index of its last token
        self._indexed = 0  # n-grams ending before this index (and followed by a token) are in

    def _catch_up(self, context: list[int]) -> None:
        # An n-gram is indexed once a token follows it, so the context's own tail never matches itself.
        for end in range(max(self._indexed, self.min_n - 1), len(context) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self._ends[tuple(context[end - n + 1 : end + 1])] = end
        self._indexed = max(self._indexed, len(context) - 1)

    def propose(self, context: list[int], k: int) -> list[int]:
        """Up to `k` tokens that may follow `context`; [] when no n-gram recurs."""
        if len(context) < self._indexed + 1:  # the context was cut back: start over
            self._ends.clear()
            self._indexed = 0
        self._catch_up(context)
        if k <= 0:
            return []
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            end = self._ends.get(tuple(context[-n:]))
            if end is not None:
                # the match ends `period` tokens before the context does: the text repeats with that
                # period since the match began, and the draft goes on repeating it
                follows, period = end + 1, len(context) - 1 - end
                return [context[follows + i % period] for i in range(k)]
        return []
