"""Multi-token-prediction (MTP) weights: which checkpoints ship them and how `split` keeps them.

Two layouts are served, both written to `core/mtp.safetensors` as `mtp.{i}.<name>`, where a layer
holds `enorm`, `hnorm`, `eh_proj`, `shared_head.norm` and a decoder layer's own parameters (its
routed experts stacked as mlx-lm stacks the model's). They stay in core: never split to workers.

- DeepSeek-V3 (DeepSeek-V3/V3.2, GLM-4.5/4.6/4.7, GLM-5): `num_nextn_predict_layers` extra decoder
  layers after the model's own, stored as `model.layers.{N+i}.*` with N = num_hidden_layers.
- Qwen3-Next / Qwen3.5 (`mtp_num_hidden_layers`): `mtp.fc`, `mtp.pre_fc_norm_embedding`,
  `mtp.pre_fc_norm_hidden`, `mtp.norm`, shared by `mtp.layers.{i}.*` (full-attention decoder
  layers). They compute what DeepSeek's do: `fc` is `eh_proj`, the two pre-fc norms are `enorm` and
  `hnorm`, `norm` is `shared_head.norm`.

mlx-lm's `sanitize()` drops both, so `split` reads them from the checkpoint's files itself. Each
decoder layer passes through `model.sanitize()` under the name of one of the model's own layers,
so it gets exactly the conversions those get (experts stacked or unfused, FP8 blocks dequantized,
MLA's kv_b_proj split, Qwen's zero-centred norms offset by one).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from services.common.model_shape import text_config

MTP_FILE = "mtp.safetensors"
DEEPSEEK_LAYOUT = ("deepseek_v3", "deepseek_v32", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa")
QWEN_LAYOUT = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
FAMILIES = DEEPSEEK_LAYOUT + QWEN_LAYOUT
# Copies of the main model's embedding and output head: the main model's own serve.
_SHARED = ("embed_tokens.", "shared_head.head.")
_AS_LAYER_0 = "model.layers.0."
# Qwen's shared MTP norms by the DeepSeek names the drafter gives them; `fc.*` becomes `eh_proj.*`.
_QWEN_NORMS = {
    "pre_fc_norm_embedding.weight": "enorm.weight",
    "pre_fc_norm_hidden.weight": "hnorm.weight",
    "norm.weight": "shared_head.norm.weight",
}


def mtp_layer_count(config: dict) -> int:
    """How many MTP layers the checkpoint's config declares (0 for none)."""
    text = text_config(config)
    return int(text.get("num_nextn_predict_layers") or text.get("mtp_num_hidden_layers") or 0)


def mtp_block_index(config: dict) -> int:
    """The layer index an MTP decoder layer is built (and sanitized) as: past the model's layers
    for DeepSeek's layout, the model's first full-attention layer for Qwen's hybrid models."""
    text = text_config(config)
    if config.get("model_type") in QWEN_LAYOUT:
        return int(text.get("full_attention_interval", 4)) - 1
    return int(text["num_hidden_layers"])


def unsupported_reason(config: dict) -> str | None:
    """Why `--speculative mtp` cannot serve this model, or None when it can."""
    text = text_config(config)
    family = config.get("model_type")
    if family not in QWEN_LAYOUT and "text_config" in config:
        return f"{family} wraps its language model; its MTP layers are not served"
    if family not in FAMILIES:
        return f"{family} has no multi-token-prediction layers moe-mesh can serve (it serves {', '.join(FAMILIES)})"
    if mtp_layer_count(config) == 0:
        key = "mtp_num_hidden_layers" if family in QWEN_LAYOUT else "num_nextn_predict_layers"
        return f"this {family} checkpoint declares no MTP layers ({key} is 0)"
    if text.get("mtp_use_dedicated_embeddings"):
        return f"this {family} checkpoint gives its MTP layers embeddings of their own, which are not served"
    return None


def extract_mtp_weights(model_path: Path, config: dict, model) -> dict[str, mx.array]:
    """The checkpoint's MTP layers as `mtp.{i}.<name in the layer>`; empty when it ships none (or
    not in a layout served here)."""
    if unsupported_reason(config) is not None:
        return {}
    files = sorted(Path(model_path).glob("*.safetensors"))
    if config.get("model_type") in QWEN_LAYOUT:
        return _qwen_layout(files, config, model)
    return _deepseek_layout(files, config, model)


def _deepseek_layout(files: list[Path], config: dict, model) -> dict[str, mx.array]:
    first = mtp_block_index(config)
    prefixes = {f"model.layers.{first + i}.": i for i in range(mtp_layer_count(config))}
    found: dict[int, dict[str, mx.array]] = {i: {} for i in prefixes.values()}
    for file in files:
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


def _mtp_suffix(key: str) -> str | None:
    """`key` past its `mtp.` part (at the start or after a dot), or None for the model's own."""
    head, found, rest = key.partition("mtp.")
    return rest if found and (head == "" or head.endswith(".")) else None


def _qwen_layout(files: list[Path], config: dict, model) -> dict[str, mx.array]:
    """The shared `mtp.*` parameters under DeepSeek's names, and each `mtp.layers.{i}` sanitized as
    the model's full-attention layer `mtp_block_index`. The model's sanitize decides from the whole
    checkpoint whether its norms are zero-centred (Hugging Face's files) or already offset (MLX's),
    so it also sees one of the checkpoint's own convolution weights; the offset it applies to the
    layer's norm is applied to the shared norms too."""
    mtp: dict[str, mx.array] = {}
    sample: dict[str, mx.array] = {}  # one convolution weight, which tells the files' form
    layer_prefix = None  # how the checkpoint names its decoder layers, e.g. "model.language_model."
    for file in files:
        for key, value in mx.load(str(file)).items():
            rest = _mtp_suffix(key)
            if rest is not None:
                mtp[rest] = value
            elif "conv1d.weight" in key and not sample:
                sample[key] = value
            elif layer_prefix is None and ".input_layernorm." in key and "layers." in key:
                layer_prefix = key[: key.index("layers.")]
    if layer_prefix is None or not mtp:
        return {}
    at = f"layers.{mtp_block_index(config)}."
    out: dict[str, mx.array] = {}
    for i in range(mtp_layer_count(config)):
        own = f"layers.{i}."
        layer = {f"{layer_prefix}{at}{k[len(own) :]}": v for k, v in mtp.items() if k.startswith(own)}
        sanitized = model.sanitize({**layer, **sample})
        block = {k.split(at, 1)[1]: v for k, v in sanitized.items() if at in k}
        offset = _norm_offset(
            layer.get(f"{layer_prefix}{at}input_layernorm.weight"), block.get("input_layernorm.weight")
        )
        for name, value in mtp.items():
            if name in _QWEN_NORMS:
                block[_QWEN_NORMS[name]] = value + offset if offset else value
            elif name.startswith("fc."):
                block["eh_proj." + name.removeprefix("fc.")] = value
        out.update({f"mtp.{i}.{k}": v for k, v in block.items()})
    return out


def _norm_offset(stored: mx.array | None, sanitized: mx.array | None) -> int:
    """What the model's sanitize added to a norm weight: 1 for zero-centred norms, else 0."""
    if stored is None or sanitized is None:
        return 0
    return round((sanitized.astype(mx.float32) - stored.astype(mx.float32)).mean().item())
