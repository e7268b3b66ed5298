"""Constrained decoding: output that is guaranteed to match a grammar (JSON, JSON Schema, tool calls).

The grammar engine is llguidance (the Rust engine behind Guidance, also used by vLLM,
SGLang and llama.cpp): it compiles JSON Schemas and Lark grammars and computes, per
step, the set of vocabulary tokens that keep the output inside the grammar. A
`GrammarConstraint` is an mlx-lm logits processor: before each sample it feeds the
grammar the token sampled last, asks for the next-token mask and pushes every other
logit to -1e30 (probability exactly 0). Nothing outside the grammar can be sampled, so
the text parses unless generation is cut short (max_tokens -> finish_reason length, as
OpenAI reports it).
"""

from __future__ import annotations

import json
import threading
from copy import copy

import llguidance
import mlx.core as mx
import numpy as np
from mlx_lm.tokenizer_utils import TokenizerWrapper

from services.common.logging import get_logger
from services.proto.moemesh.v1 import core_pb2

log = get_logger(__name__)

MAX_SCHEMA_CHARS = 64 * 1024
JSON_TOOL_PARSER = "mlx_lm.tool_parsers.json_tools"
# No free whitespace between JSON tokens: with it, a weak (or random) model can emit
# whitespace until max_tokens, never closing the object. Separators as json.dumps writes them.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar the client sent (a schema, a tool's parameters) cannot be compiled; says why."""


def rust_tokenizer_json(hf_tokenizer) -> str:
    """A fast tokenizer's Rust tokenizer as JSON, without padding or truncation: what
    `llguidance.hf.from_tokenizer` hands llguidance, without its copy of the whole tokenizer
    (a second JSON round trip of every token) when neither is set, as chat tokenizers have it."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("only fast (Rust) tokenizers are supported")
    if backend.padding is not None or backend.truncation is not None:
        backend = copy(backend)  # the model's own tokenizer keeps its settings
        backend.no_padding()
        backend.no_truncation()
    return backend.to_str()


class GrammarTokenizer:
    """llguidance's view of the model's vocabulary, built once per core (about a second for 151k tokens).

    `vocab_size` is the width of the model's logits, which may exceed the tokenizer's
    vocabulary (padded embeddings); tokens past the tokenizer are never allowed.
    """

    def __init__(self, tokenizer: TokenizerWrapper, vocab_size: int):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._built: llguidance.LLTokenizer | None = None
        self._unavailable: str | None = None  # why it cannot be built; not retried per request
        self._lock = threading.Lock()

    def get(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._built is None and self._unavailable is None:
                try:
                    self._built = llguidance.LLTokenizer(
                        rust_tokenizer_json(self._tokenizer._tokenizer),
                        n_vocab=self.vocab_size,
                        eos_token=sorted(self._tokenizer.eos_token_ids),
                    )
                except (ValueError, TypeError) as error:  # e.g. a slow (non-Rust) tokenizer
                    self._unavailable = (
                        f"constrained decoding is not available for this model's tokenizer: {error}"
                    )
            if self._built is None:
                raise GrammarError(self._unavailable)
            return self._built


def response_format_grammar(response_format: core_pb2.ResponseFormat) -> str | None:
    """The llguidance grammar for a request's response_format, or None for plain text."""
    kind = response_format.type
    if kind == core_pb2.ResponseFormat.TEXT:
        return None
    if kind == core_pb2.ResponseFormat.JSON_OBJECT:
        return _schema_grammar({"type": "object"}, "response_format")
    if kind == core_pb2.ResponseFormat.JSON_SCHEMA:
        schema = parse_schema(response_format.schema_json, "response_format.schema_json")
        return _schema_grammar(schema, "response_format.schema_json")
    raise GrammarError(f"response_format.type: unknown type {kind}")


def tool_call_grammar(tools: list[dict], start: str, end: str, single: bool) -> str:
    """A Lark grammar for one (single) or more tool calls in the JSON-in-tags format
    (`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, Qwen2.5/Qwen3/Hermes),
    where each call names one of `tools` and its arguments follow that tool's schema.

    `start`/`end` are Lark terms for the markers: a quoted literal, or `<[id]>` for a
    special token (a special token never matches its text spelled out in bytes)."""
    rules = []
    for index, tool in enumerate(tools):
        schema = {
            "type": "object",
            "properties": {
                "name": {"const": tool["name"]},
                "arguments": tool["parameters"] or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
            "x-guidance": JSON_LAYOUT,
        }
        rules.append(f"tool{index}: %json {json.dumps(schema)}")
    alternatives = " | ".join(f"tool{index}" for index in range(len(tools)))
    calls = "call" if single else 'call ("\\n" call)*'
    lines = [f"start: {calls}", f'call: {start} "\\n" ({alternatives}) "\\n" {end}', *rules]
    return llguidance.LLMatcher.grammar_from_lark("\n".join(lines))


def marker_term(text: str, token_ids: tuple[int, ...] | None, tokenizer: llguidance.LLTokenizer) -> str:
    """The Lark term for a marker such as `<tool_call>`."""
    if token_ids and len(token_ids) == 1 and tokenizer.is_special_token(token_ids[0]):
        return f"<[{token_ids[0]}]>"
    return json.dumps(text)


def parse_schema(text: str, field: str) -> dict:
    if not text:
        raise GrammarError(f"{field}: a JSON schema is required")
    if len(text) > MAX_SCHEMA_CHARS:
        raise GrammarError(f"{field}: the schema is longer than {MAX_SCHEMA_CHARS} characters")
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as error:
        raise GrammarError(f"{field}: not valid JSON: {error}") from None
    if not isinstance(schema, dict):
        raise GrammarError(f"{field}: a JSON schema must be a JSON object")
    return schema


def _schema_grammar(schema: dict, field: str) -> str:
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_LAYOUT)
    except ValueError as error:
        raise GrammarError(f"{field}: {error}") from None


def check_grammar(grammar: str, tokenizer: llguidance.LLTokenizer, field: str) -> None:
    """Compile the grammar now, so that an unsupported or contradictory schema is the
    client's INVALID_ARGUMENT instead of a stuck generation."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        raise GrammarError(f"{field}: {messages[0] if messages else 'invalid'}")


class GrammarConstraint:
    """An mlx-lm logits processor that keeps one sequence's output inside a grammar.

    Called once per generated token with the sequence's tokens so far and the logits
    [1, V] for the next one. The first call's context ends with the prompt; each later
    call's context has grown by the token sampled last, which is fed to the grammar
    before the next mask is computed.

    `wait_for` (token ids of a thinking model's end-of-thinking marker) leaves the
    output unconstrained until the model has closed a thinking block that the prompt
    opened; the grammar applies to what follows, as vLLM does with reasoning parsers.

    A grammar that somehow reaches an error state (it cannot with masking, but a
    bug in the engine must not turn into garbage) allows only end-of-sequence.
    """

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str, wait_for: tuple[int, ...] = ()):
        self.matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error())
        self.vocab_size = tokenizer.vocab_size
        self.eos_tokens = list(tokenizer.eos_tokens)
        self.wait_for = list(wait_for)
        self._seen = -1  # context length already processed; -1 before the first call
        self._waiting_tail: list[int] = []

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._seen < 0:
            self._seen = len(tokens)
        elif len(tokens) > self._seen:
            new = tokens[self._seen :].tolist()
            self._seen = len(tokens)
            self._consume(new)
        if self.wait_for:
            return logits
        return apply_mask(logits, self.allowed())

    def _consume(self, new_tokens: list[int]) -> None:
        if self.wait_for:
            joined = self._waiting_tail + new_tokens
            width = len(self.wait_for)
            for start in range(len(joined) - width + 1):
                if joined[start : start + width] == self.wait_for:
                    self.wait_for, self._waiting_tail = [], []
                    self._consume(joined[start + width :])
                    return
            self._waiting_tail = joined[len(joined) - width + 1 :] if width > 1 else []
            return
        for token in new_tokens:
            if not self.matcher.consume_token(token):
                log.error("grammar_rejected_token", token=token, error=self.matcher.get_error())

    def allowed(self) -> np.ndarray:
        """Boolean mask [vocab_size] of the tokens the grammar allows next."""
        if self.matcher.is_error():
            mask = np.zeros(self.vocab_size, dtype=bool)
            mask[self.eos_tokens] = True
            return mask
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little", count=self.vocab_size).view(bool)


# What a disallowed token's logit becomes: far below any real logit, so its probability
# underflows to exactly 0 (float32 exp(x) == 0 for x < -104) and greedy, Gumbel and
# top-p/min-p sampling can never pick it. An additive bias costs ~0.17 ms on 151k logits on
# the CPU where mx.where costs ~1 ms, and unlike -inf it keeps logprobs finite for JSON.
DISALLOWED = np.float32(-1e30)


def apply_mask(logits: mx.array, allowed: np.ndarray) -> mx.array:
    width = logits.shape[-1]
    if allowed.shape[0] < width:
        allowed = np.concatenate([allowed, np.zeros(width - allowed.shape[0], dtype=bool)])
    bias = (allowed[:width].astype(np.float32) - np.float32(1)) * -DISALLOWED
    return logits + mx.array(bias)
