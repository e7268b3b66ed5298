"""Random multi-token-prediction layers for tiny checkpoints, stored as the published checkpoints
ship them, in a file of their own that mlx-lm's loader does not read:

- DeepSeek-V3 / GLM-4.5: `model.layers.{N}.*` after the model's N layers, routed experts one tensor
  per expert (Hugging Face's layout; mlx-lm's deepseek_v3 `sanitize()` drops only the published
  model's MTP layer, 61).
- Qwen3.5: `mtp.fc`, `mtp.pre_fc_norm_{embedding,hidden}`, `mtp.norm` and `mtp.layers.{i}.*`, a
  full-attention layer whose routed experts are fused as in Hugging Face's files (`gate_up_proj`,
  `down_proj`). Its norms are stored offset, as the tiny checkpoint's own layers are (MLX's form,
  which mlx-lm's sanitize tells by the model's convolution weights).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten

from services.core.speculative.mtp import text_model
from services.core.speculative.mtp_weights import QWEN_LAYOUT, mtp_block_index, mtp_layer_count

MTP_SHARD = "mtp-layers.safetensors"


def write_random_mtp_layers(out_dir: Path, model, config: dict, dtype: mx.Dtype) -> None:
    """The config's MTP layers, random, of `model`'s decoder-layer kind."""
    text = text_model(model)
    hidden = int(text.args.hidden_size)
    layer_class = type(text.model.layers[-1])
    index = mtp_block_index(config)
    qwen = config.get("model_type") in QWEN_LAYOUT
    weights: dict[str, mx.array] = {}
    if qwen:
        weights.update(
            _own(hidden, dtype, ("mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_hidden", "mtp.norm"), "mtp.fc")
        )
    for i in range(mtp_layer_count(config)):
        if qwen:
            prefix, own = f"mtp.layers.{i}.", {}
        else:
            prefix = f"model.layers.{index + i}."
            own = _own(hidden, dtype, ("enorm", "hnorm", "shared_head.norm"), "eh_proj")
            # copies of the main model's, as the published checkpoints carry them
            own["embed_tokens.weight"] = text.model.embed_tokens.weight
            own["shared_head.head.weight"] = text.lm_head.weight
        block = layer_class(text.args, index + (0 if qwen else i))
        made = {n: (v * 2.0).astype(dtype) if v.ndim > 1 else v for n, v in tree_flatten(block.parameters())}
        weights.update({prefix + name: value for name, value in _as_stored(made, config).items()})
        weights.update({prefix + name: value for name, value in own.items()})
    mx.save_safetensors(str(Path(out_dir) / MTP_SHARD), weights, metadata={"format": "mlx"})


def _own(hidden: int, dtype: mx.Dtype, norms: tuple[str, ...], projection: str) -> dict[str, mx.array]:
    out = {f"{norm}.weight": mx.ones((hidden,)) for norm in norms}
    out[f"{projection}.weight"] = (nn.Linear(2 * hidden, hidden, bias=False).weight * 2.0).astype(dtype)
    return out


def _as_stored(params: dict[str, mx.array], config: dict) -> dict[str, mx.array]:
    """A layer's parameters under the names (and in the form) Hugging Face's files store them."""
    out = {n: v for n, v in params.items() if ".switch_mlp." not in n}
    for name, value in params.items():
        if ".switch_mlp." not in name:
            continue
        module = name[: name.index(".switch_mlp.")]
        if config.get("model_type") not in ("qwen3_5", "qwen3_5_moe"):
            out.update(
                {name.replace(".switch_mlp.", f".experts.{e}."): value[e] for e in range(value.shape[0])}
            )
        elif name.endswith("down_proj.weight"):
            out[f"{module}.experts.down_proj"] = value
        elif name.endswith("gate_proj.weight"):  # gate rows, then up rows
            up = params[name.replace("gate_proj", "up_proj")]
            out[f"{module}.experts.gate_up_proj"] = mx.concatenate([value, up], axis=-2)
    return out
