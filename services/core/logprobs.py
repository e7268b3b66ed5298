"""Token logprobs as `TokenLogprob` messages: of sampled tokens, and of the prompt's own tokens.

Prompt logprobs (the completions API's echo + logprobs, vLLM's prompt_logprobs) are what
evaluation harnesses score texts with: the logprob of every prompt token given the ones before
it. mlx-lm's prefill computes the logits of every prompt position and drops them;
`prefill_keeping_logprobs` is its `PromptProcessingBatch.prompt` (mlx-lm 0.32, pinned) that keeps
them for the rows that asked.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
from mlx_lm.generate import PromptProcessingBatch

from services.common.mlx_lm_adapter import right_pad_prompts
from services.core.token_bytes import TokenBytes
from services.proto.moemesh.v1 import core_pb2


def prefill_keeping_logprobs(
    batch: PromptProcessingBatch, tokens: list[list[int]], rows: set[int]
) -> dict[int, mx.array]:
    """Prefill `tokens` (one chunk per row, as `BatchStep` cuts them) into the batch's caches,
    as `batch.prompt(tokens)` does, and return {row: log-softmax of its positions' logits} for
    `rows`: entry j scores the token that follows the row's j-th token of the chunk."""
    if not rows or not tokens:
        batch.prompt(tokens)
        return {}
    if len(batch.uids) != len(tokens):
        raise ValueError("The batch length doesn't match the number of inputs")
    for kept, chunk in zip(batch.tokens, tokens, strict=True):
        kept.extend(chunk)  # the tokens the KV cache holds, as prompt() keeps them
    lengths = [len(chunk) for chunk in tokens]
    padding = [max(lengths) - length for length in lengths]
    if max(padding) > 0:
        inputs = right_pad_prompts(tokens, max_length=max(lengths))
        for cache in batch.prompt_cache:
            cache.prepare(lengths=lengths, right_padding=padding)
    else:
        inputs = mx.array(tokens)
    logits = batch.model(inputs, cache=batch.prompt_cache)
    logprobs = {}
    for row in rows:
        scores = logits[row, : lengths[row]].astype(mx.float32)
        logprobs[row] = scores - mx.logsumexp(scores, axis=-1, keepdims=True)
    mx.eval([cache.state for cache in batch.prompt_cache], *logprobs.values())
    if max(padding) > 0:
        for cache in batch.prompt_cache:
            cache.finalize()
        mx.eval([cache.state for cache in batch.prompt_cache])
    mx.clear_cache()
    return logprobs


class LogprobWriter:
    """Fills `TokenLogprob` messages: the token, its text alone, its own bytes, its logprob and
    the `top` most likely tokens at that position, best first."""

    def __init__(self, tokenizer, token_bytes: TokenBytes):
        self.tokenizer = tokenizer
        self.token_bytes = token_bytes
        # a prompt chunk's alternatives are thousands of lookups, on the engine thread
        self.text = lru_cache(maxsize=65536)(lambda token_id: tokenizer.decode([token_id]))

    def entry(self, token_id: int, logprob: float = 0.0) -> core_pb2.TokenLogprob:
        return core_pb2.TokenLogprob(
            token_id=token_id,
            token=self.text(token_id),
            logprob=logprob,
            token_bytes=self.token_bytes.of(token_id),
        )

    def add_top(self, entry: core_pb2.TokenLogprob, ids: list[int], values: list[float]) -> None:
        for token_id, value in zip(ids, values, strict=True):
            entry.top.add(
                token_id=token_id,
                token=self.text(token_id),
                logprob=value,
                token_bytes=self.token_bytes.of(token_id),
            )

    def sampled(self, token_id: int, logprobs: mx.array, top: int) -> core_pb2.TokenLogprob:
        """One generated token, from its position's logprobs over the vocabulary."""
        entry = self.entry(token_id, logprobs[token_id].item())
        if top:
            ids, values = _best(logprobs[None], top)
            self.add_top(entry, ids[0], values[0])
        return entry

    def scored(self, targets: list[int], logprobs: mx.array, top: int) -> list[core_pb2.TokenLogprob]:
        """Prompt tokens `targets`, each scored by one row of `logprobs` (the position before it)."""
        chosen = mx.take_along_axis(logprobs, mx.array(targets)[:, None], axis=-1)[:, 0].tolist()
        entries = [self.entry(t, value) for t, value in zip(targets, chosen, strict=True)]
        if top:
            ids, values = _best(logprobs, top)
            for entry, row_ids, row_values in zip(entries, ids, values, strict=True):
                self.add_top(entry, row_ids, row_values)
        return entries


def _best(logprobs: mx.array, top: int) -> tuple[list[list[int]], list[list[float]]]:
    """The `top` best token ids of every row of `logprobs`, best first, and their logprobs."""
    best = mx.argpartition(-logprobs, kth=top - 1, axis=-1)[:, :top]
    values = mx.take_along_axis(logprobs, best, axis=-1)
    order = mx.argsort(-values, axis=-1)
    best = mx.take_along_axis(best, order, axis=-1)
    return best.tolist(), mx.take_along_axis(values, order, axis=-1).tolist()
