"""Build mlx-lm models without their weights, and find their routed experts.

Core and workers both start from mlx-lm's own architecture classes: core keeps
everything but the routed experts, a worker keeps only those. The routed experts
are recognised by class (mlx-lm's `SwitchGLU` / `SwitchMLP`), never by attribute
name, so every mlx-lm MoE architecture works without per-architecture code.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP
from mlx_lm.utils import infer_quant_config

from services.common.checkpoint_layouts import model_classes as mended_classes

EXPERT_MODULE_TYPES = (SwitchGLU, SwitchMLP)


class UnsupportedModelError(ValueError):
    """The checkpoint is not an mlx-lm architecture, or not a Mixture-of-Experts."""


def check_batchable(model: nn.Module, model_type: str) -> None:
    """Core's engine batches sequences with mlx-lm's batch classes, which merge each layer's
    cache across sequences; raise UnsupportedModelError naming the family when a cache of this
    model cannot merge (as mlx-lm's own server then falls back to one request at a time)."""
    from mlx_lm.models.cache import make_prompt_cache

    unbatchable = sorted(
        {type(cache).__name__ for cache in make_prompt_cache(model) if not hasattr(cache, "merge")}
    )
    if unbatchable:
        raise UnsupportedModelError(
            f"{model_type} cannot be served: its KV cache ({', '.join(unbatchable)}) cannot be batched "
            "by mlx-lm's batch classes, which core's engine runs on"
        )


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a weight we have not read (enough to pick quantization)."""

    shape: tuple[int, ...]
    dtype: mx.Dtype


def read_checkpoint_config(checkpoint: Path) -> dict:
    """`checkpoint/config.json` of an mlx-lm / Hugging Face checkpoint whose architecture mlx-lm
    knows; UnsupportedModelError naming the file otherwise."""
    path = Path(checkpoint) / "config.json"
    if not path.is_file():
        raise UnsupportedModelError(
            f"{checkpoint} has no config.json: not an mlx-lm / Hugging Face checkpoint"
        )
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise UnsupportedModelError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise UnsupportedModelError(f"{path} must hold a JSON object, not a {type(config).__name__}")
    model_classes(config)  # an unknown architecture: a clear error before anything loads
    return config


def model_classes(config: Mapping[str, Any]):
    model_type = config.get("model_type")
    if not model_type:
        raise UnsupportedModelError("config.json has no model_type: not an mlx-lm / Hugging Face checkpoint")
    try:
        return mended_classes(dict(config))
    except ValueError as error:
        raise UnsupportedModelError(f"model_type {model_type!r} is not an mlx-lm architecture") from error


def build_skeleton(config: Mapping[str, Any]) -> nn.Module:
    """The model with mlx-lm's random (lazy, never evaluated) initial parameters."""
    model_class, args_class = model_classes(config)
    return model_class(args_class.from_dict(dict(config)))


def expert_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(dotted path, module) of every routed-expert module, in model order."""
    # named_modules() lists deepest-last-first; reversed it is in layer order.
    for path, module in model.named_modules()[::-1]:
        if isinstance(module, EXPERT_MODULE_TYPES):
            yield path, module


def expert_width(module: nn.Module) -> int | None:
    """The width of the vectors an expert module takes and returns: the output width of its last
    projection (mlx-lm's SwitchGLU `down_proj`, SwitchMLP `fc2`; quantization packs only the
    input side of a weight, so its output side reads as is). Usually the model's hidden size, but
    not where a model projects into a latent space around its experts (nemotron_h's
    `moe_latent_size`). None for a module with neither projection."""
    for name in ("down_proj", "fc2"):
        weight = getattr(getattr(module, name, None), "weight", None)
        if weight is not None:
            return int(weight.shape[-2])
    return None


def quantize_like_mlx_lm(
    model: nn.Module,
    config: Mapping[str, Any],
    weights: Mapping[str, Any],
    only_under: set[str] | None = None,
) -> None:
    """Quantize the modules whose saved weights are quantized, as mlx_lm.utils.load_model does.

    `weights` maps parameter names to arrays or TensorSpecs; only shapes and dtypes are read.
    `only_under` limits the work to modules below these dotted paths (a worker's experts).
    """
    quantization = config.get("quantization")
    if not quantization:
        return

    def class_predicate(path: str, module: nn.Module) -> bool | dict:
        if only_under is not None and not any(path.startswith(root + ".") for root in only_under):
            return False
        if path in quantization:
            return quantization[path]
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        params = infer_quant_config(path, module, weights)
        if f"{path}.global_scale" in weights:
            params["global_scale"] = True
        return params

    nn.quantize(
        model,
        group_size=quantization["group_size"],
        bits=quantization["bits"],
        mode=quantization.get("mode", "affine"),
        class_predicate=class_predicate,
    )
