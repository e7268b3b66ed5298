"""The engine's settings (`moe-mesh core` flags) and its token counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.core.kv import KV_CACHE_KINDS
from services.core.speculative.metrics import SpeculativeCounters


@dataclass
class EngineConfig:
    max_num_seqs: int = 16  # sequences in the running batch (decoding or prefilling)
    max_queue: int = 256  # admitted sequences waiting for a place in the batch
    # Tokens one step computes: one per decoding sequence plus the prefill chunk. Bounding it keeps
    # a long prompt from freezing the streams that decode beside it.
    max_num_batched_tokens: int = 512
    # While sequences decode, a step's prefill chunk is also cut to what fits this many seconds
    # (services/core/prefill_pacer.py); 0: tokens only
    max_step_seconds: float = 1.0
    prefix_cache_bytes: int = 1 << 30  # 0 turns prefix caching off
    image_cache_bytes: int = 1 << 30  # vision-tower outputs kept by image (models with images only)
    kv_cache: str = "fp16"  # the launch default; a request may ask for another kind
    kv_settings: object | None = None  # services.core.kv.KVCacheSettings for turboquant
    max_model_len: int | None = None  # the context a request may fill; None: the model's own
    idle_probe_s: float = 2.0
    speculative: object | None = None  # services.core.speculative.SpeculativeConfig; None: off
    # Batches per KV kind whose expert calls the step pipelines (services/core/kind_batches.py)
    micro_batches: int = 1
    # From idle, keep admitting a burst's requests while they arrive this close together, so
    # they share one prefill step (services/core/inbox.py); 0: step at the first arrival
    burst_gather_s: float = 0.002

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "micro_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be at least 1")
        if self.max_queue < 0 or self.prefix_cache_bytes < 0 or self.burst_gather_s < 0:
            raise ValueError("max-queue, the prefix cache budget and burst-gather-ms must not be negative")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max-model-len must be at least 1")
        if self.kv_cache not in KV_CACHE_KINDS:
            raise ValueError(f"kv-cache must be one of {', '.join(KV_CACHE_KINDS)}, not {self.kv_cache!r}")


@dataclass
class EngineCounters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    speculative: SpeculativeCounters = field(default_factory=SpeculativeCounters)
