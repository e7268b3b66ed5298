"""Which MoE layers core computes in its own process (expert_link/local.py); light to import,
since the command line reads it before any model code loads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.common.ranges import parse_ranges

if TYPE_CHECKING:
    from services.common.manifest import Manifest


@dataclass(frozen=True)
class LocalExpertsSpec:
    """What core itself serves: whole MoE layers (`layers`, ranges such as "0-23" or "all") and
    the memory budget of their experts (None: all resident)."""

    layers: str = "all"
    memory_gb: float | None = None

    def owned(self, manifest: Manifest) -> dict[int, list[int]]:
        """layer -> every expert of it, for the MoE layers `layers` names."""
        moe = {layer.layer: layer.num_experts for layer in manifest.layers}
        chosen = parse_ranges(self.layers, max(moe) + 1, "local experts' layers")
        return {layer: list(range(moe[layer])) for layer in chosen if layer in moe}
