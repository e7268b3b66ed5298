"""The raw UTF-8 bytes of single tokens, for logprobs.

A token may hold part of a character (CJK, emoji: byte-level BPE and SentencePiece byte
fallback split them), which `tokenizer.decode([id])` can only show as U+FFFD. OpenAI's logprobs
carry each token's `bytes` so that clients can rebuild such characters, so core sends the
token's own bytes, read from its vocabulary piece the way mlx-lm's streaming detokenizers read
it: byte-level BPE pieces through the GPT-2 byte map, SentencePiece pieces with "▁" as a space
and "<0xNN>" as a byte.
"""

from __future__ import annotations

from functools import lru_cache

from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    SPMStreamingDetokenizer,
    TokenizerWrapper,
    _byte_decoder,
)

from services.common.mlx_lm_adapter import SPM_SPACE
from services.core.output_prep import hidden_special_ids


class TokenBytes:
    def __init__(self, tokenizer: TokenizerWrapper):
        self._tokenizer = tokenizer
        self._detokenizer = detokenizer = tokenizer.detokenizer  # (its SPM table is shared, not copied)
        self._kind = (
            "bpe"
            if isinstance(detokenizer, BPEStreamingDetokenizer)
            else "spm"
            if isinstance(detokenizer, SPMStreamingDetokenizer)
            else "text"
        )
        # control tokens add nothing to an answer's text (TextEmitter leaves them out): no bytes
        self._hidden = hidden_special_ids(tokenizer)
        self._special = set(getattr(tokenizer, "all_special_ids", None) or ())
        self.of = lru_cache(maxsize=65536)(self._bytes)

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._hidden:
            return b""
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if piece is None or token_id in self._special or self._kind == "text":
            return self._tokenizer.decode([token_id]).encode("utf-8")
        if self._kind == "spm":  # mlx-lm's own table: "<0xNN>" pieces as their byte
            return self._detokenizer.tokenmap[token_id].replace(SPM_SPACE, b" ")
        table = _byte_decoder()
        if all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return piece.encode("utf-8")  # an added token written as plain text
