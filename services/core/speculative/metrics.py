"""Speculative decoding counters under vLLM's names, on core's /metrics and in GetStats."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import Counter

from services.core.speculative.config import MAX_SPECULATIVE_TOKENS

DRAFTS = Counter("vllm:spec_decode_num_drafts", "Sequences' drafts verified.")
DRAFT_TOKENS = Counter("vllm:spec_decode_num_draft_tokens", "Drafted tokens verified.")
ACCEPTED_TOKENS = Counter("vllm:spec_decode_num_accepted_tokens", "Drafted tokens accepted.")
ACCEPTED_PER_POSITION = Counter(
    "vllm:spec_decode_num_accepted_tokens_per_pos",
    "Drafted tokens accepted, by their position in the draft.",
    ["position"],
)


@dataclass
class SpeculativeCounters:
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=lambda: [0] * MAX_SPECULATIVE_TOKENS)

    def record(self, drafted: int, kept: int) -> None:
        if not drafted:
            return
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted_tokens += kept
        DRAFTS.inc()
        DRAFT_TOKENS.inc(drafted)
        if kept:
            ACCEPTED_TOKENS.inc(kept)
        for position in range(kept):
            self.accepted_per_position[position] += 1
            ACCEPTED_PER_POSITION.labels(str(position)).inc()
