"""Experts in core's own process: a worker's store and compute, with no hop at all.

Selected by a worker whose address is `local` (cluster.toml `address = "local"`, `moe-mesh core
--worker local`, `moe-mesh up --local-experts`). The experts are read from the split's layer
files by the same `ExpertStore` a worker process uses, under the same memory budget, and
computed by the same `ExpertCompute`. A layer whose experts are all resident and computed by
MLX gets mlx-lm's own module inside core's model, so the step evaluates once, as monolithic
mlx-lm does. Every other local layer (a streamed shard, or the CPU kernel) evaluates its
hidden states and expert ids once and computes on the host, as a worker would, minus the wire.

A local worker serves whole layers (its experts are "all"): a layer is either local or on
worker processes.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx import nn

from services.common import tensor_codec
from services.common.logging import get_logger
from services.common.manifest import Manifest
from services.core.expert_link.local_spec import LocalExpertsSpec
from services.core.expert_link.proxy import synced_inputs

log = get_logger(__name__)


class HostComputedExperts(nn.Module):
    """A local layer that cannot join the graph (streamed experts, or the CPU kernel): one
    synchronisation of hidden states and ids, then the worker's compute on the host."""

    def __init__(self, layer: int, compute):
        super().__init__()
        self._layer = layer
        self._compute = compute

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        flat_x, flat_ids, _ = synced_inputs(x, indices)
        rows = self._compute.compute_rows(self._layer, np.asarray(flat_x), np.asarray(flat_ids))
        return tensor_codec.to_mlx(rows).reshape(*indices.shape, x.shape[-1])


class LocalExperts:
    """The store and compute of core's local expert worker, and a module per layer it serves."""

    def __init__(self, split_dir: Path, manifest: Manifest, spec: LocalExpertsSpec, kernel: str = "auto"):
        from services.experts.compute import ExpertCompute
        from services.experts.store_setup import open_store

        owned = spec.owned(manifest)
        self.store, self.budget_bytes = open_store(split_dir, manifest, owned, spec.memory_gb)
        self.compute = ExpertCompute(self.store, kernel=kernel)
        self.layers = sorted(owned)

    def modules(self) -> dict[int, nn.Module]:
        """layer -> what replaces its routed-expert module in core's model."""
        out = {}
        for layer in self.layers:
            module = self.compute.in_graph_module(layer)
            out[layer] = module if module is not None else HostComputedExperts(layer, self.compute)
        in_graph = sum(not isinstance(m, HostComputedExperts) for m in out.values())
        log.info("local_experts", layers=len(out), in_graph=in_graph, on_host=len(out) - in_graph)
        return out

    def close(self) -> None:
        self.store.close()
