"""Drafting with a small model in core (`--speculative draft:PATH`): a dense or MoE mlx-lm
checkpoint with the target's tokenizer drafts each sequence's next tokens greedily.

A greedy draft is a deterministic function of the context, so verification treats it as a
one-hot draft distribution and rejection sampling stays exact (acceptance.py). Each sequence
keeps its own draft KV cache, cut back to the tokens it shares with the sequence whenever drafts
were rejected, so a step feeds the draft model only what is new."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

PROBE = 'The quick brown fox, 42 times: <tool_call>{"a": [1, 2]}</tool_call>\n  def f(x):'


class DraftModelDrafter:
    def __init__(self, model, vocab_size: int):
        self.model = model
        self.vocab_size = vocab_size

    def index(self) -> DraftSequence:
        return DraftSequence(self.model, self.vocab_size)


def load_draft_model(path: str, tokenizer, vocab_size: int) -> DraftModelDrafter:
    """The draft model at `path`; refused unless it tokenizes as the served model does."""
    location = Path(path).expanduser()
    try:
        model, draft_tokenizer = mlx_lm.load(str(location) if location.exists() else path)
    except Exception as error:
        raise ValueError(f"draft model {path!r} could not be loaded: {error}") from error
    if draft_tokenizer.encode(PROBE) != tokenizer.encode(PROBE):
        raise ValueError(f"draft model {path!r} does not share the served model's tokenizer")
    cache = make_prompt_cache(model)
    if not can_trim_prompt_cache(cache):
        raise ValueError(
            f"draft model {path!r} keeps a cache that cannot be cut back (recurrent or windowed)"
        )
    return DraftModelDrafter(model, vocab_size)


class DraftSequence:
    """One sequence's draft-model state; `propose(context, k)` with the same, growing context.

    The k drafts come back as a lazy [k] array: each draft token feeds the next forward on the
    device, so the caller evaluates every sequence's drafts of a step together, in one sync."""

    def __init__(self, model, vocab_size: int):
        self.model = model
        self.vocab_size = vocab_size
        self.cache = make_prompt_cache(model)
        self.fed: list[int] = []  # the tokens in `cache`
        self._sure = 0  # a prefix length `fed` and every later context share
        self._unread: tuple[list[int], mx.array] | None = None  # fed, and drafts fed but for the last

    def propose(self, context: list[int], k: int) -> mx.array | list[int]:
        if k <= 0:
            return []
        self._cut_to(context)
        todo = context[len(self.fed) :]  # at least the context's last token, never yet fed
        inputs = mx.array([todo])
        drafts = []
        for _ in range(k):
            logits = self.model(inputs, cache=self.cache)[0, -1, : self.vocab_size]
            token = mx.argmax(logits)
            drafts.append(token)
            inputs = token.reshape(1, 1)
        self._unread = (todo, mx.stack(drafts))
        self._sure = len(context)
        return self._unread[1]

    def _read_drafts(self) -> None:
        """Record as fed what the last proposal fed: its new context tokens and every draft but
        the last (read once the caller has evaluated them)."""
        if self._unread is not None:
            todo, drafts = self._unread
            self._unread = None
            self.fed += todo + drafts.tolist()[:-1]

    def _cut_to(self, context: list[int]) -> None:
        """Drop from the draft cache what the context does not share (rejected drafts), and the
        context's last token, which the next forward feeds."""
        self._read_drafts()
        shared = self._sure
        limit = min(len(self.fed), len(context) - 1)
        while shared < limit and self.fed[shared] == context[shared]:
            shared += 1
        shared = min(shared, limit)
        if shared < len(self.fed):
            trim_prompt_cache(self.cache, len(self.fed) - shared)
            del self.fed[shared:]
