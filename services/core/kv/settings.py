"""Launch-time choice of KV cache and the TurboQuant knobs."""

from __future__ import annotations

from dataclasses import dataclass

from services.core.kv.codebook import SUPPORTED_BITS

KV_CACHE_KINDS = ("fp16", "turboquant")


@dataclass(frozen=True)
class KVCacheSettings:
    """TurboQuant settings. The default is the issue's: K3+QJL / V3 (~4.25 / 3.125 bits per
    coordinate at head_dim 128), 4 exact sink tokens and a 128-token exact window. On the demo
    model (4096 tokens of GPL-3, each query seeing its own window exact, `bench/kv_quality.py`)
    perplexity rises +1.07 / +0.82 / +0.56 % over three rotation seeds (the 3 % bar), so the
    window costs only 128 tokens of fp16 per sequence and layer.

    key_bits / value_bits: MSE-stage bits (2, 3 or 4; 1 is allowed for experiments).
    key_qjl: add the 1-bit QJL residual stage to keys (unbiased inner products).
    sink_tokens: the first tokens of a sequence, kept exact (attention sinks).
    recent_window: the newest tokens kept exact; older ones are compressed in blocks of
    block_size as they age. seed: the rotations of layer i use seed + i.
    center_keys / center_values: quantize x - mu instead of x, mu the mean of the first
    compressed block (per sequence, layer and KV head), and store every token, exact or
    packed, that way. TurboQuant's error scales with the norm it quantizes, and a real
    model's keys share a large common part (the demo model's mean key holds ~55% of the
    squared norm), so centering halves the key error. The shift is free: scores move by
    one constant per query (q.mu), which the softmax ignores, and the value offset is
    added back to the output once. Off by default, as in the issue's algorithm: on the demo
    model it halves K3+QJL's perplexity loss (+1.07% -> +0.49%) and moves greedy decisions
    less (lead shifts 0.23 against 0.30 nats rms,
    bench/results/kv_quality-cpu-w128-greedy-20-lead-shifts-more.json), yet K4/V3 in the same
    memory does better still (+0.47%, 0.18 nats)."""

    key_bits: int = 3
    value_bits: int = 3
    key_qjl: bool = True
    sink_tokens: int = 4
    recent_window: int = 128
    block_size: int = 64
    seed: int = 0
    center_keys: bool = False
    center_values: bool = False

    def __post_init__(self) -> None:
        for name in ("key_bits", "value_bits"):
            if getattr(self, name) not in SUPPORTED_BITS:
                raise ValueError(f"{name} must be one of {SUPPORTED_BITS}, got {getattr(self, name)}")
        for name in ("sink_tokens", "recent_window"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    def describe(self) -> str:
        qjl = "+QJL" if self.key_qjl else ""
        return f"K{self.key_bits}{qjl}/V{self.value_bits}"
