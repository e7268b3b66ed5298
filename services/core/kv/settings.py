"""Launch-time choice of KV cache and the TurboQuant knobs."""

from __future__ import annotations

from dataclasses import dataclass

from services.core.kv.codebook import SUPPORTED_BITS

KV_CACHE_KINDS = ("fp16", "turboquant")


@dataclass(frozen=True)
class KVCacheSettings:
    """TurboQuant settings. The default is K4/V3: keys 4-bit MSE stage (no QJL), values 3-bit,
    4.125 / 3.125 bits per coordinate at head_dim 128 plus the norms, 4 exact sink tokens and a
    128-token exact window. It uses about the memory of the paper's K3+QJL/V3 and serves
    attention better (perplexity, greedy answers and decode speed: docs/benchmarks.md,
    TurboQuant). Why: QJL makes each score unbiased but adds variance,
    (pi/2 - 1)|q|^2|r|^2/d for a residual r, about twice the score-error variance of 4-bit MSE
    keys, whose only bias is a slight uniform shrink of every score -- a softmax temperature
    change the softmax barely feels, while it does feel the variance. PAPER_SETTINGS is the
    paper's K3+QJL/V3.

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
    added back to the output once. Off by default: on the demo model it halves K3+QJL's
    perplexity loss (+1.07% -> +0.49%) and moves greedy decisions less (0.23 against 0.30
    nats rms), yet K4/V3 without it does better still (+0.47%, 0.18 nats)."""

    key_bits: int = 4
    value_bits: int = 3
    key_qjl: bool = False
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


# The paper's configuration, as the issue specifies it: 3-bit MSE keys plus the 1-bit QJL
# residual stage (~4.25 bits), 3-bit values. `--kv-key-bits 3 --kv-qjl` selects it.
PAPER_SETTINGS = KVCacheSettings(key_bits=3, key_qjl=True)
