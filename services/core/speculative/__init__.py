"""Speculative decoding: draft several tokens per sequence, verify them in one forward."""

from services.core.speculative.config import SpeculativeConfig, speculative_config
from services.core.speculative.decode import SpeculativeDecoder
from services.core.speculative.metrics import SpeculativeCounters

__all__ = ["SpeculativeConfig", "SpeculativeCounters", "SpeculativeDecoder", "speculative_config"]
