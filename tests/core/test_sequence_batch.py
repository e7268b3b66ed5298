"""The engine's own scheduling state (`SequenceBatch`) stepped by `BatchStep`: requests that join
at different steps, with chunked prefill, give the tokens mlx-lm's `BatchGenerator` gives them,
and a sequence leaves from any stage with its cache."""

from __future__ import annotations

import mlx_lm
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import greedy_sampler as greedy

from services.core.batch_step import BatchStep
from services.core.sequence_batch import SequenceBatch


@pytest.fixture(scope="module")
def model(tiny_models):
    loaded, _ = mlx_lm.load(str(tiny_models.checkpoint("qwen3_moe", None)))
    return loaded


def step(sequences: SequenceBatch):
    batch_step = BatchStep(sequences)
    return batch_step.finish([task() for task in batch_step.tasks])


# (prompt, max_tokens, the step it arrives at)
ARRIVALS = [
    (list(range(3, 17)), 9, 0),
    (list(range(40, 43)), 6, 0),
    (list(range(60, 83)), 7, 2),
    ([5], 4, 5),
    (list(range(90, 101)), 5, 5),
]


def run(insert, advance, done) -> tuple[dict, dict]:
    """Each arrival's tokens and finish reason, inserting arrivals at their steps."""
    tokens, reasons, uids, at = {}, {}, {}, 0
    while len(reasons) < len(ARRIVALS):
        for index, (prompt, limit, arrives) in enumerate(ARRIVALS):
            if arrives == at:
                uids[insert(prompt, limit)] = index
        for response in advance():
            tokens.setdefault(uids[response.uid], []).append(response.token)
            if response.finish_reason:
                reasons[uids[response.uid]] = response.finish_reason
        at += 1
        assert at < 200, "never finished"
    assert done()
    return tokens, reasons


def test_staggered_chunked_requests_get_mlx_lms_batch_generator_tokens(model):
    generator = BatchGenerator(model, sampler=greedy, prefill_step_size=4)
    expected = run(
        lambda prompt, limit: generator.insert([prompt], [limit])[0],
        lambda: generator.next()[1],
        lambda: True,
    )
    generator.close()
    sequences = SequenceBatch(model, max_sequences=32, prefill_chunk=4)
    got = run(
        lambda prompt, limit: sequences.insert([prompt], limit, sampler=greedy),
        lambda: step(sequences)[1],
        lambda: sequences.size() == 0,
    )
    assert got == expected
    assert got[1] == {i: "length" for i in range(len(ARRIVALS))}


def test_prefill_reports_progress_and_stops_at_segment_ends(model):
    sequences = SequenceBatch(model, max_sequences=4, prefill_chunk=3)
    uid = sequences.insert([[1, 2, 3, 4], [5, 6, 7, 8]], 2, sampler=greedy)
    reported = []
    while not any(r.end_of_prompt for r in reported):
        reported += step(sequences)[0]
    assert [(r.progress, r.end_of_segment, r.end_of_prompt) for r in reported] == [
        ((3, 8), False, False),
        ((4, 8), True, False),  # the first segment's end: its KV can be kept there
        ((7, 8), True, False),  # all but the last token, whose forward samples the first answer
        ((8, 8), True, True),
    ]
    assert all(r.uid == uid for r in reported)


def test_a_sequence_leaves_any_stage_with_its_cache(model):
    sequences = SequenceBatch(model, max_sequences=2, prefill_chunk=4)
    sequences.max_prefilling = 1  # one prompt at a time: the third request waits
    decoding = sequences.insert([[3, 4, 5]], 20, sampler=greedy)
    prefilling = sequences.insert([list(range(10, 30))], 20, sampler=greedy)
    waiting = sequences.insert([[7, 8]], 20, sampler=greedy)
    for _ in range(4):
        step(sequences)
    assert sequences.generation_batch.uids == [decoding]
    assert sequences.prompt_batch.uids == [prefilling]
    assert [s.uid for s in sequences.waiting] == [waiting]
    full = sequences.kv_bytes()

    kept = sequences.remove([prefilling], keep_caches=True)
    cache, tokens = kept[prefilling]
    assert tokens == list(range(10, 18))  # two chunks of 4 prefilled
    assert cache[0].offset == 8
    assert sequences.prompt_batch.uids == [] and sequences.prefilling == []
    assert sequences.kv_bytes() < full

    kept = sequences.remove([decoding, waiting], keep_caches=True)
    cache, tokens = kept[waiting]
    assert tokens == [] and cache[0].offset == 0  # nothing of it computed yet
    assert kept[decoding][1][:3] == [3, 4, 5] and len(kept[decoding][1]) >= 3
    assert sequences.size() == 0 and sequences.kv_bytes() == 0

    again = sequences.insert([[3, 4, 5]], 2, sampler=greedy)  # the batch serves on after emptying
    answers = []
    while len(answers) < 2:
        answers += step(sequences)[1]
    assert [a.uid for a in answers] == [again, again] and answers[-1].finish_reason == "length"


def test_a_bad_sequence_is_refused_and_nothing_is_queued(model):
    sequences = SequenceBatch(model, max_sequences=2, prefill_chunk=4)
    with pytest.raises(ValueError, match="empty"):
        sequences.insert([[], []], 4)
    with pytest.raises(ValueError, match="max_tokens"):
        sequences.insert([[1, 2]], 0)
    assert sequences.size() == 0
