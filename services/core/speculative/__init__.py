"""Speculative decoding: draft several tokens per sequence, verify them in one forward."""

from services.core.speculative.config import SpeculativeConfig, speculative_config
from services.core.speculative.decode import SpeculativeDecoder, make_drafter
from services.core.speculative.metrics import SpeculativeCounters

__all__ = [
    "SpeculativeConfig",
    "SpeculativeCounters",
    "SpeculativeDecoder",
    "make_drafter",
    "speculative_config",
]
