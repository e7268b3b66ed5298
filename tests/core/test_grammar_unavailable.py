"""The grammar engine's view of the vocabulary: the one llguidance builds itself, and a tokenizer
the engine cannot read costs constrained requests only, and clearly."""

from __future__ import annotations

import llguidance
import llguidance.hf
import pytest
from mlx_lm.tokenizer_utils import load

from services.core.structured_output import GrammarError, GrammarTokenizer, rust_tokenizer_json
from services.tools.synthetic_model import qwen3_tokenizer_dir

TEXTS = ['{"name": "Ada", "age": 36}', "  héllo\n\twörld ✓", "<|im_start|>user\nhi<|im_end|>"]


@pytest.mark.slow  # builds vocabularies for seconds
@pytest.mark.parametrize("settings", ["plain", "padding and truncation set"])
def test_the_vocabulary_equals_llguidances_own_and_leaves_the_tokenizer_as_it_was(settings):
    tokenizer = load(qwen3_tokenizer_dir())
    backend = tokenizer._tokenizer.backend_tokenizer
    if settings != "plain":
        backend.enable_padding(length=64)
        backend.enable_truncation(max_length=128)
    eos = sorted(tokenizer.eos_token_ids)
    before = backend.to_str()
    ours = GrammarTokenizer(tokenizer, vocab_size=151936).get()
    theirs = llguidance.hf.from_tokenizer(tokenizer._tokenizer, n_vocab=151936, eos_token=eos)
    assert backend.to_str() == before  # padding and truncation stay the model tokenizer's
    assert (ours.vocab_size, ours.eos_tokens) == (theirs.vocab_size, theirs.eos_tokens)
    for text in TEXTS:
        assert ours.tokenize_str(text) == theirs.tokenize_str(text)
    assert [ours.decode_bytes([i]) for i in range(0, 151936, 997)] == [
        theirs.decode_bytes([i]) for i in range(0, 151936, 997)
    ]


def test_a_tokenizer_without_a_rust_one_is_refused_clearly():
    with pytest.raises(ValueError, match="only fast"):
        rust_tokenizer_json(object())


@pytest.mark.slow  # builds a vocabulary for seconds
def test_unreadable_vocabulary_fails_each_request_with_the_reason_without_rebuilding(monkeypatch):
    tokenizer = load(qwen3_tokenizer_dir())
    builds = []
    real_build = llguidance.LLTokenizer
    monkeypatch.setattr(llguidance, "LLTokenizer", lambda *a, **k: builds.append(1) or real_build(*a, **k))
    # Logits narrower than the tokenizer's vocabulary: llguidance refuses to map it.
    grammar_tokenizer = GrammarTokenizer(tokenizer, vocab_size=1000)
    for _ in range(2):
        with pytest.raises(GrammarError, match="constrained decoding is not available"):
            grammar_tokenizer.get()
    assert len(builds) == 1  # the failure is remembered, not rebuilt (seconds) per request
