"""Every name moe-mesh takes from mlx-lm beyond its public API, in one module.

Core's engine keeps its own scheduling state and runs mlx-lm's public batch classes
(`PromptProcessingBatch`, `GenerationBatch`). Beyond them it verifies drafted tokens inside a
`GenerationBatch`'s decode state, trims batch KV caches in place and reuses a few helpers.
mlx-lm may rename any of these in a release. Each is read here under a name of moe-mesh's own,
and tests/core/test_mlx_lm_adapter.py checks every one against the installed mlx-lm, so an
upgrade fails there, by name.
"""

from __future__ import annotations

from mlx_lm.generate import _right_pad_prompts
from mlx_lm.models.cache import _BaseCache
from mlx_lm.tokenizer_utils import SPMStreamingDetokenizer
from mlx_lm.utils import _get_classes

BaseCache = _BaseCache  # the base of mlx-lm's caches: state, from_state, size, nbytes, empty
right_pad_prompts = _right_pad_prompts  # token lists -> one right-padded [B, max_length] array
classes_for_config = _get_classes  # a config dict -> (Model, ModelArgs) of its model_type
SPM_SPACE = SPMStreamingDetokenizer._sep  # what SentencePiece pieces write for a space


class DecodeState:
    """A `GenerationBatch`'s per-row decode state, as `GenerationBatch._step` leaves it: the
    token each row feeds next (already sampled) with its logprobs, the tokens each row has
    emitted, its logits processors' token context and its stop matcher."""

    __slots__ = ("batch",)

    def __init__(self, batch):
        self.batch = batch

    @property
    def next_tokens(self):
        return self.batch._next_tokens

    @property
    def next_logprobs(self) -> list:
        return self.batch._next_logprobs

    def advance(self, fed_tokens, fed_logprobs: list, next_tokens, next_logprobs: list) -> None:
        """What `_step` leaves after a step: the tokens it fed (and their logprobs) become the
        current ones, the newly sampled ones are next."""
        self.batch._current_tokens = fed_tokens
        self.batch._current_logprobs = fed_logprobs
        self.batch._next_tokens = next_tokens
        self.batch._next_logprobs = next_logprobs

    @property
    def emitted(self) -> list[int]:
        """Tokens each row has generated (counted against its max_tokens)."""
        return self.batch._num_tokens

    @property
    def token_context(self) -> list:
        """Each row's context buffer for its logits processors."""
        return self.batch._token_context

    @property
    def stop_matchers(self) -> list:
        return self.batch._matchers


def write_index(cache) -> int:
    """A `BatchKVCache`'s next write slot (every row's end, left padding included)."""
    return cache._idx


def right_padding(cache):
    """A `BatchKVCache`'s right padding while a right-padded prefill is pending, else None."""
    return cache._right_padding
