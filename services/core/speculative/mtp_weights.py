"""Multi-token-prediction (MTP) weights: which checkpoints ship them and how `split` keeps them.

The DeepSeek-V3 layout (DeepSeek-V3/V3.2, GLM-4.5/4.6/4.7, GLM-5): `num_nextn_predict_layers` extra
decoder layers after the model's own, stored as `model.layers.{N+i}.*` with N = num_hidden_layers.
Each holds `enorm`, `hnorm`, `eh_proj`, `shared_head.norm` and a whole decoder layer (attention and
a MoE with its routed experts). mlx-lm's `sanitize()` drops them, so `split` reads them from the
checkpoint's files itself and writes them to `core/mtp.safetensors` as `mtp.{i}.*`, routed experts
stacked as mlx-lm stacks the model's own. They stay in core: never split to workers.

The Qwen3-Next / Qwen3.5 layout (`mtp.*`: `fc`, `pre_fc_norm_*`, `layers.*`, `norm`) is not served
yet: `--speculative mtp` refuses those models by name (`ngram` and `draft:PATH` serve them).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from services.common.model_shape import text_config

MTP_FILE = "mtp.safetensors"
FAMILIES = ("deepseek_v3", "deepseek_v32", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa")
UNSERVED_MTP_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
# Copies of the main model's embedding and output head: the main model's own serve.
_SHARED = ("embed_tokens.", "shared_head.head.")
_AS_LAYER_0 = "model.layers.0."


def mtp_layer_count(config: dict) -> int:
    """How many MTP layers the checkpoint's config declares (0 for none)."""
    return int(text_config(config).get("num_nextn_predict_layers") or 0)


def unsupported_reason(config: dict) -> str | None:
    """Why `--speculative mtp` cannot serve this model, or None when it can."""
    text = text_config(config)
    model_type = text.get("model_type", config.get("model_type"))
    if model_type in UNSERVED_MTP_FAMILIES or config.get("model_type") in UNSERVED_MTP_FAMILIES:
        model_type = config.get("model_type")
        return (
            f"{model_type}'s MTP layers (mtp.* weights) are not served yet; --speculative ngram or "
            "draft:PATH serve this model"
        )
    if "text_config" in config:
        return f"{config.get('model_type')} wraps its language model; its MTP layers are not served"
    if model_type not in FAMILIES:
        return f"{model_type} has no multi-token-prediction layers moe-mesh can serve (it serves {', '.join(FAMILIES)})"
    if mtp_layer_count(config) == 0:
        return f"this {model_type} checkpoint declares no MTP layers (num_nextn_predict_layers is 0)"
    return None


def extract_mtp_weights(model_path: Path, config: dict, model) -> dict[str, mx.array]:
    """The checkpoint's MTP layers as `mtp.{i}.<name in the layer>`; empty when it ships none (or
    not in a layout served here). Each layer passes through `model.sanitize()` under the name of
    the model's layer 0, so it gets exactly the conversions the model's own layers get (routed
    experts stacked, FP8 blocks dequantized, MLA's kv_b_proj split)."""
    if unsupported_reason(config) is not None:
        return {}
    first = int(text_config(config)["num_hidden_layers"])
    prefixes = {f"model.layers.{first + i}.": i for i in range(mtp_layer_count(config))}
    found: dict[int, dict[str, mx.array]] = {i: {} for i in prefixes.values()}
    for file in sorted(Path(model_path).glob("*.safetensors")):
        for key, value in mx.load(str(file)).items():
            for prefix, i in prefixes.items():
                if key.startswith(prefix) and not key[len(prefix) :].startswith(_SHARED):
                    found[i][_AS_LAYER_0 + key[len(prefix) :]] = value
    out: dict[str, mx.array] = {}
    for i, layer in found.items():
        sanitized = model.sanitize(layer) if hasattr(model, "sanitize") and layer else layer
        out.update(
            {
                f"mtp.{i}.{k.removeprefix(_AS_LAYER_0)}": v
                for k, v in sanitized.items()
                if k.startswith(_AS_LAYER_0)
            }
        )
    return out
