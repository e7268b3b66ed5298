"""A tokenizer the grammar engine cannot read costs constrained requests only, and clearly."""

from __future__ import annotations

import llguidance.hf
import pytest
from mlx_lm.tokenizer_utils import load

from services.core.structured_output import GrammarError, GrammarTokenizer
from services.tools.synthetic_model import qwen3_tokenizer_dir


@pytest.mark.slow  # builds a vocabulary for seconds
def test_unreadable_vocabulary_fails_each_request_with_the_reason_without_rebuilding(monkeypatch):
    tokenizer = load(qwen3_tokenizer_dir())
    builds = []
    real_build = llguidance.hf.from_tokenizer
    monkeypatch.setattr(
        llguidance.hf, "from_tokenizer", lambda *a, **k: builds.append(1) or real_build(*a, **k)
    )
    # Logits narrower than the tokenizer's vocabulary: llguidance refuses to map it.
    grammar_tokenizer = GrammarTokenizer(tokenizer, vocab_size=1000)
    for _ in range(2):
        with pytest.raises(GrammarError, match="constrained decoding is not available"):
            grammar_tokenizer.get()
    assert len(builds) == 1  # the failure is remembered, not rebuilt (seconds) per request
