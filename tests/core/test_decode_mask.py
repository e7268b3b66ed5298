"""A decode step leaves out the attention mask only where the batch has no left padding, and
the tokens stay mlx-lm's either way."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import BatchKVCache

from services.core.batch_step import BatchStep
from services.core.decode_mask import skip_decode_mask_if_unpadded
from services.core.sequence_batch import SequenceBatch


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def solo_tokens(model, prompt: list[int], count: int) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=count, sampler=greedy)]


@pytest.mark.slow  # decodes for seconds
def test_a_padded_batch_keeps_its_mask_and_an_aligned_one_drops_it(tiny_models):
    model, _ = mlx_lm.load(str(tiny_models.checkpoint("qwen3_moe", None)))
    short, long = list(range(3, 8)), list(range(20, 32))
    sequences = SequenceBatch(model, max_sequences=4, prefill_chunk=2048)
    uid_short = sequences.insert([short], 4, sampler=greedy)
    uid_long = sequences.insert([long], 10, sampler=greedy)
    tokens: dict[int, list[int]] = {uid_short: [], uid_long: []}
    unpadded_by_rows: dict[int, set[bool]] = {}
    while any(len(t) < n for t, n in ((tokens[uid_short], 4), (tokens[uid_long], 10))):
        step = BatchStep(sequences)
        batch = sequences.generation_batch
        if len(batch) > 0:
            unpadded_by_rows.setdefault(len(batch), set()).add(batch.prompt_cache[0].decode_unpadded)
        _, responses = step.finish([task() for task in step.tasks])
        for response in responses:
            tokens[response.uid].append(response.token)
    # two rows of different lengths: padded, masked; the long one alone: aligned, unmasked
    assert unpadded_by_rows == {2: {False}, 1: {True}}
    assert tokens[uid_short] == solo_tokens(model, short, 4)
    assert tokens[uid_long] == solo_tokens(model, long, 10)


def test_the_mask_is_left_out_only_for_one_token_without_a_window():
    cache = BatchKVCache(left_padding=[0, 0])
    cache.update_and_fetch(mx.zeros((2, 1, 3, 4)), mx.zeros((2, 1, 3, 4)))
    assert skip_decode_mask_if_unpadded([cache]) is True
    assert cache.make_mask(1) is None
    assert cache.make_mask(1, window_size=2) is not None
    assert cache.make_mask(2) is not None

    padded = BatchKVCache(left_padding=[2, 0])
    padded.update_and_fetch(mx.zeros((2, 1, 3, 4)), mx.zeros((2, 1, 3, 4)))
    assert skip_decode_mask_if_unpadded([padded]) is False
    mask = padded.make_mask(1)
    assert mask is not None and mask.tolist()[0][0][0][:2] == [False, False]
