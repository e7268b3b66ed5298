"""Each token's own bytes, for logprobs: joined in order they give back the text, characters
split across tokens included, for byte-level BPE (Qwen3's tokenizer, the demo's SmolLM2) and for
SentencePiece-style tokenizers with byte fallback (Llama 2, Mistral, Gemma)."""

from __future__ import annotations

import json

import pytest
from mlx_lm.tokenizer_utils import SPMStreamingDetokenizer, load

from services.core.text_output import TextEmitter
from services.core.token_bytes import TokenBytes
from services.tools.synthetic_model import qwen3_tokenizer_dir

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


@pytest.fixture(scope="module")
def spm_tokenizer(tmp_path_factory):
    """A small SentencePiece-style tokenizer as Llama 2 / Mistral ship it in tokenizer.json: "▁" for
    spaces, "<0xNN>" pieces for bytes the vocabulary lacks, mlx-lm's SPM detokenizer."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, normalizers, trainers

    model = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    model.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    model.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    byte_pieces = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *byte_pieces])
    model.train_from_iterator(["the quick brown fox jumps over the lazy dog " * 20, "naïve"], trainer)
    folder = tmp_path_factory.mktemp("spm")
    model.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "unk_token": "<unk>"}))
    return load(folder)


def test_sentencepiece_token_bytes_join_into_the_streamed_text(spm_tokenizer):
    assert isinstance(spm_tokenizer.detokenizer, SPMStreamingDetokenizer)
    ids = spm_tokenizer.encode(TEXT, add_special_tokens=False)
    pieces = [TokenBytes(spm_tokenizer).of(i) for i in ids]
    assert any(len(p) == 1 and p[0] >= 0x80 for p in pieces)  # byte-fallback pieces: part of a character
    emitter = TextEmitter(spm_tokenizer.detokenizer, [])
    streamed = "".join(emitter.add(i).text for i in ids) + emitter.finish().text
    # the text core streams keeps SentencePiece's leading space (it may continue a prompt)
    assert b"".join(pieces).decode("utf-8") == streamed == " " + TEXT
