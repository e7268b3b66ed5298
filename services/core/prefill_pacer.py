"""How many prompt tokens a step may prefill.

`--max-num-batched-tokens` bounds a step's tokens, which bounds its time only where tokens are
cheap. Where they are not (a CPU, a big model on a small machine), one 512-token chunk can take
tens of seconds, and everything that happens between steps waits that long: the next token of every
stream decoding beside it, a new request joining the batch, a cancel taking effect. So the chunk is
also sized to a time target: the pacer keeps running estimates of a decode-only step's time and of
the cost of one prefill token, and grants the tokens that fit the target.

While sequences decode, the target is `--max-step-seconds`. With nothing decoding only newcomers and
cancels wait, so a prompt prefilling alone gets ALONE_FACTOR times that, in chunks of at least
ALONE_MIN_TOKENS: big enough that a slow machine's prefill throughput does not suffer, and a short
request arriving behind an abandoned long prompt starts within seconds, not after the whole chunk.

Chunks that follow the clock are not repeatable; what the model computes does not depend on them
with the fp16 cache, nor with TurboQuant on CPUs (each query sees the tokens compressed by its own
position, services/core/kv/cache.py CHUNK_INVARIANT_PREFILL; on GPUs it may).
"""

from __future__ import annotations

PROBE_TOKENS = 8  # the first chunk beside decoding streams, before any cost is known: small
MIN_TOKENS = 8  # a prompt always moves on, however tight the target; chunks are multiples of it
ALONE_FACTOR = 4  # a prompt prefilling alone may take this many times the step-time target
ALONE_MIN_TOKENS = 64  # ... in chunks no smaller than this (also its first chunk, cost unknown)
_WEIGHT = 0.3  # of a new observation in the running estimates


class PrefillPacer:
    def __init__(self, target_s: float):
        self.target_s = target_s  # 0 or less: no time target, tokens only
        self.decode_s: float | None = None  # a step that only decodes
        self.token_s: float | None = None  # one more prefill token in a step beside decoding
        self.alone_token_s: float | None = None  # a prefill-only step's time per token

    def budget(self, tokens: int, decoding: int) -> int:
        """Prefill tokens this step may take, out of `tokens` (the token budget left after the
        `decoding` sequences' one token each)."""
        if self.target_s <= 0 or tokens <= MIN_TOKENS:
            return tokens
        if decoding == 0:
            if self.alone_token_s is None:
                return min(tokens, ALONE_MIN_TOKENS)
            return _fitting(
                tokens, ALONE_FACTOR * self.target_s / max(self.alone_token_s, 1e-9), ALONE_MIN_TOKENS
            )
        if self.token_s is None:
            return min(tokens, PROBE_TOKENS)
        room = self.target_s - (self.decode_s or 0.0)
        return _fitting(tokens, room / max(self.token_s, 1e-9), MIN_TOKENS)

    def observe(self, seconds: float, prefill_tokens: int, decoding: int) -> None:
        """A step took `seconds` to prefill `prefill_tokens` beside `decoding` sequences. Steps
        that also decode teach the extra cost of a prefill token (a decode step's own time known);
        prefill-only steps teach their time per token, fixed cost included (which errs short)."""
        if not decoding:
            if prefill_tokens:
                self.alone_token_s = _blend(self.alone_token_s, seconds / prefill_tokens)
            return
        if prefill_tokens == 0:
            self.decode_s = _blend(self.decode_s, seconds)
        elif self.decode_s is not None:
            self.token_s = _blend(self.token_s, max(seconds - self.decode_s, 0.0) / prefill_tokens)


def _fitting(tokens: int, fits: float, floor: int) -> int:
    """min(tokens, fits), at least `floor`, cut to a multiple of MIN_TOKENS (few distinct chunk
    shapes to compile); `fits` may be huge where tokens are cheap."""
    granted = int(min(float(tokens), max(fits, 0.0)))
    return min(tokens, max(floor, granted // MIN_TOKENS * MIN_TOKENS))


def _blend(old: float | None, new: float) -> float:
    return new if old is None else (1 - _WEIGHT) * old + _WEIGHT * new
