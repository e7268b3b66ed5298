"""Load core's part of a split checkpoint: mlx-lm's model with remote experts.

Order matters: the routed-expert modules are swapped for `RemoteExperts` *before*
quantization and weight loading, so core allocates nothing for them and
`load_weights(strict=True)` proves core.safetensors holds exactly the rest.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx import nn
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_tokenizer

from metal.linear_cpu import use_cpu_kernels
from services.common.manifest import Manifest
from services.common.model_build import build_skeleton, check_batchable, quantize_like_mlx_lm
from services.common.module_paths import replace_modules
from services.core.expert_link.dispatcher import ExpertDispatcher
from services.core.expert_link.in_flight import settle_pending
from services.core.expert_link.proxy import RemoteExperts


def load_core_model(
    split_dir: Path,
    manifest: Manifest,
    dispatcher: ExpertDispatcher | None,
    dense_kernel: str = "auto",
    local_modules: dict[int, nn.Module] | None = None,
) -> tuple[nn.Module, int]:
    """(model, how many quantized projections compute with metal/linear_cpu.py): with
    `dense_kernel` "auto", those where MLX runs on the CPU; "mlx" keeps MLX's own op.
    `local_modules`: layer -> the module computing its experts in this process (expert_link/
    local.py); every other MoE layer calls `dispatcher`. They go in after the weights load, so
    the strict load still proves core.safetensors holds exactly core's part."""
    local_modules = local_modules or {}
    model = build_skeleton(manifest.config)
    check_batchable(model, manifest.model_type)  # a split made before this check existed
    replace_modules(
        model, {layer.module: RemoteExperts(layer.layer, dispatcher) for layer in manifest.layers}
    )
    weights = mx.load(str(Path(split_dir) / "core" / "core.safetensors"))
    quantize_like_mlx_lm(model, manifest.config, weights)
    model.eval()
    model.load_weights(list(weights.items()), strict=True)
    replace_modules(
        model,
        {
            layer.module: local_modules[layer.layer]
            for layer in manifest.layers
            if layer.layer in local_modules
        },
    )
    mx.eval(model.parameters())
    on_kernel = 0
    if dense_kernel == "auto" and mx.default_device() == mx.cpu:
        on_kernel = use_cpu_kernels(model, settle=settle_pending)
    return model, on_kernel


def load_core_tokenizer(split_dir: Path, manifest: Manifest) -> TokenizerWrapper:
    eos = manifest.config.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else eos
    return load_tokenizer(Path(split_dir) / "core", eos_token_ids=eos_ids)
