"""Each token's own bytes, for logprobs: joined in order they give back the text, characters
split across tokens included, for byte-level BPE (Qwen3's tokenizer, the demo's SmolLM2) alike."""

from __future__ import annotations

import pytest
from mlx_lm.tokenizer_utils import load

from services.common.synthetic_model import qwen3_tokenizer_dir
from services.core.token_bytes import TokenBytes

TEXT = "日本語 🚀 naïve Ünïcödé, ok\n"


@pytest.fixture(scope="module")
def tokenizer():
    return load(qwen3_tokenizer_dir())


def test_token_bytes_join_into_the_text(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    token_bytes = TokenBytes(tokenizer)
    pieces = [token_bytes.of(i) for i in ids]
    assert b"".join(pieces).decode("utf-8") == TEXT
    # some token holds part of a character: alone it decodes to U+FFFD, its bytes are its own
    split = [p for p in pieces if p.decode("utf-8", errors="replace") != p.decode("utf-8", errors="ignore")]
    assert split and all(0 < len(p) < 4 for p in split)


def test_control_tokens_have_no_bytes_as_they_have_no_text(tokenizer):
    """The answer's text leaves control tokens out (TextEmitter), so their logprob bytes are empty
    and the bytes of a stream still join into its text."""
    token_bytes = TokenBytes(tokenizer)
    (end,) = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    assert token_bytes.of(end) == b""
    (think,) = tokenizer.encode("<think>", add_special_tokens=False)
    assert token_bytes.of(think) == b"<think>"  # a marker the router reads keeps its text
