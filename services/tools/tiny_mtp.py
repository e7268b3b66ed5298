"""Random multi-token-prediction layers for tiny checkpoints, stored as DeepSeek-V3 and GLM-4.5
ship them: `model.layers.{N}.*` after the model's N layers, routed experts one tensor per expert
(Hugging Face's layout). They go in a file of their own that mlx-lm's loader does not read:
its deepseek_v3 `sanitize()` drops the MTP layer of the published model (layer 61) only."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten

MTP_SHARD = "mtp-layers.safetensors"


def write_random_mtp_layers(out_dir: Path, model, config: dict, dtype: mx.Dtype) -> None:
    """`config["num_nextn_predict_layers"]` random MTP layers of `model`'s decoder-layer kind."""
    first = int(config["num_hidden_layers"])
    hidden = int(config["hidden_size"])
    layer_class = type(model.model.layers[-1])
    weights: dict[str, mx.array] = {}
    for i in range(int(config.get("num_nextn_predict_layers") or 0)):
        prefix = f"model.layers.{first + i}."
        block = layer_class(model.args, first + i)
        own = {
            "enorm.weight": mx.ones((hidden,)),
            "hnorm.weight": mx.ones((hidden,)),
            "shared_head.norm.weight": mx.ones((hidden,)),
            "eh_proj.weight": nn.Linear(2 * hidden, hidden, bias=False).weight,
            # copies of the main model's, as the published checkpoints carry them
            "embed_tokens.weight": model.model.embed_tokens.weight,
            "shared_head.head.weight": model.lm_head.weight,
        }
        for name, made in [*tree_flatten(block.parameters()), *own.items()]:
            copied = "embed" in name or "head.w" in name
            value = (made * 2.0).astype(dtype) if made.ndim > 1 and not copied else made
            if ".switch_mlp." in name:  # one tensor per expert, as Hugging Face stores them
                for expert in range(value.shape[0]):
                    weights[prefix + name.replace(".switch_mlp.", f".experts.{expert}.")] = value[expert]
            else:
                weights[prefix + name] = value
    mx.save_safetensors(str(Path(out_dir) / MTP_SHARD), weights, metadata={"format": "mlx"})
