"""Each assumption services/common/mlx_lm_adapter.py makes about mlx-lm's private names, checked
against the installed mlx-lm: an upgrade that renames or changes one fails here, by name."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models import qwen3_moe
from mlx_lm.models.cache import BatchKVCache, KVCache

from services.common import mlx_lm_adapter as adapter
from services.core.batch_step import BatchStep
from services.core.sequence_batch import SequenceBatch


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


@pytest.fixture(scope="module")
def model(tiny_models):
    loaded, _ = mlx_lm.load(str(tiny_models.checkpoint("qwen3_moe", None)))
    return loaded


def test_right_pad_prompts_pads_each_row_at_its_end():
    padded = adapter.right_pad_prompts([[5, 6, 7], [8]], max_length=3)
    assert padded.shape == (2, 3)
    assert padded[0].tolist() == [5, 6, 7] and padded[1, 0].item() == 8


def test_classes_for_config_names_the_model_type_classes():
    assert adapter.classes_for_config({"model_type": "qwen3_moe"}) == (qwen3_moe.Model, qwen3_moe.ModelArgs)


def test_base_cache_is_the_base_of_mlx_lm_caches():
    assert issubclass(KVCache, adapter.BaseCache) and issubclass(BatchKVCache, adapter.BaseCache)
    assert {"state", "from_state", "size", "nbytes", "empty", "is_trimmable"} <= set(dir(adapter.BaseCache))


def test_spm_space_is_sentencepieces_space_marker():
    assert adapter.SPM_SPACE == "\u2581".encode()


def test_decode_state_holds_the_pending_token_that_next_emits(model):
    sequences = SequenceBatch(model, max_sequences=2, prefill_chunk=2048)
    uid = sequences.insert([[3, 4, 5, 6]], 8, sampler=greedy)
    while len(sequences.generation_batch) == 0:
        step = BatchStep(sequences)
        step.finish([task() for task in step.tasks])
    batch = sequences.generation_batch
    decode = adapter.DecodeState(batch)
    assert decode.next_tokens.shape == (1,) and len(decode.next_logprobs) == 1
    assert decode.emitted == [1] or decode.emitted == [0]
    assert len(decode.token_context) == 1 and hasattr(decode.stop_matchers[0], "advance")
    emitted_before = decode.emitted[0]
    # What a verified draft leaves: the next token to emit is the one `advance` names.
    chosen = (decode.next_tokens[0].item() + 1) % 50
    fed = decode.next_tokens
    decode.advance(fed, decode.next_logprobs, mx.array([chosen], dtype=fed.dtype), decode.next_logprobs)
    (response,) = batch.next()
    assert response.uid == uid and response.token == chosen
    assert decode.emitted[0] == emitted_before + 1


def test_write_index_and_right_padding_of_a_batch_kv_cache():
    cache = BatchKVCache(left_padding=[2, 0])
    keys = mx.zeros((2, 1, 5, 4))
    cache.update_and_fetch(keys, keys)
    assert adapter.write_index(cache) == 5 and adapter.right_padding(cache) is None
    other = BatchKVCache(left_padding=[0, 0])
    other.prepare(lengths=[3, 1], right_padding=[0, 2])
    assert adapter.right_padding(other) is not None
