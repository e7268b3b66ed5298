"""How many prompt tokens a step may prefill while other sequences decode.

`--max-num-batched-tokens` bounds a step's tokens, which bounds its time only where tokens are
cheap. Where they are not (a CPU, a big model on a small machine), one 512-token chunk can take
tens of seconds, and every stream decoding beside it waits that long for its next token. So while
sequences decode, the prefill chunk is also sized to a time target: the pacer keeps running
estimates of a decode-only step's time and of the cost of one prefill token, and grants the
tokens that fit the target. With nothing decoding, nobody waits: the whole budget goes to prefill.
"""

from __future__ import annotations

PROBE_TOKENS = 8  # the first chunk beside decoding streams, before any cost is known: small
MIN_TOKENS = 8  # a prompt always moves on, however tight the target; chunks are multiples of it
_WEIGHT = 0.3  # of a new observation in the running estimates


class PrefillPacer:
    def __init__(self, target_s: float):
        self.target_s = target_s  # 0 or less: no time target, tokens only
        self.decode_s: float | None = None  # a step that only decodes
        self.token_s: float | None = None  # one more prefill token in a step

    def budget(self, tokens: int, decoding: int) -> int:
        """Prefill tokens this step may take, out of `tokens` (the token budget left after the
        `decoding` sequences' one token each)."""
        if decoding == 0 or self.target_s <= 0 or tokens <= MIN_TOKENS:
            return tokens
        if self.token_s is None:
            return min(tokens, PROBE_TOKENS)
        room = self.target_s - (self.decode_s or 0.0)
        fits = min(tokens, room / max(self.token_s, 1e-9))
        return max(MIN_TOKENS, int(fits) // MIN_TOKENS * MIN_TOKENS)  # few distinct chunk shapes

    def observe(self, seconds: float, prefill_tokens: int, decoding: int) -> None:
        """A step took `seconds` to prefill `prefill_tokens` beside `decoding` sequences. Only steps
        that also decode teach the token cost (what `budget` needs it for): a prompt prefilled
        alone would charge the step's fixed cost to its tokens."""
        if not decoding:
            return
        if prefill_tokens == 0:
            self.decode_s = _blend(self.decode_s, seconds)
        elif self.decode_s is not None:
            self.token_s = _blend(self.token_s, max(seconds - self.decode_s, 0.0) / prefill_tokens)


def _blend(old: float | None, new: float) -> float:
    return new if old is None else (1 - _WEIGHT) * old + _WEIGHT * new
