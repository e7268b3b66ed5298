"""What a model's config.json says about its language model: its own section of a
multimodal config, and KV bytes per token (`moe-mesh plan` states it; core sizes its KV
budget with it)."""

from __future__ import annotations

from services.common.vlm_language_models import MLX_VLM_LANGUAGE_FAMILIES


def text_config(config: dict) -> dict:
    """The language model's section: `text_config` in a multimodal config (DeepSeek-VL2's
    `language_config`), else the config."""
    return config.get("text_config") or config.get("language_config") or config


def with_text_config(config: dict) -> dict:
    """The config with its language model's keys over the top level's."""
    return {**config, **text_config(config)}


def kv_bytes_per_token(config: dict, element_bytes: float) -> tuple[float, str]:
    """KV bytes per token over the attention layers, and how it was estimated."""
    text = with_text_config(config)
    layers = int(text.get("num_hidden_layers", 0))
    heads = int(text.get("num_attention_heads", 1))
    kv_heads = int(text.get("num_key_value_heads", heads))
    head_dim = int(text.get("head_dim") or text.get("hidden_size", 0) // max(heads, 1))
    note = "2 x kv_heads x head_dim per attention layer"
    latent = "kv_lora_rank" in text and config.get("model_type") not in MLX_VLM_LANGUAGE_FAMILIES
    if latent:  # mlx-lm's MLA caches the compressed latent plus the rope key
        per_layer = int(text["kv_lora_rank"]) + int(text.get("qk_rope_head_dim", 0))
        note = "MLA: kv_lora_rank + qk_rope_head_dim per layer"
    elif text.get("qk_nope_head_dim"):  # mlx-vlm's MLA caches every head's keys and values
        per_layer = heads * sum(
            int(text.get(k, 0)) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        )
        note = "MLA, heads x (qk_nope + qk_rope + v) head dims per layer"
    else:
        per_layer = 2 * kv_heads * head_dim
    attention_layers = layers
    if "full_attention_interval" in text:  # hybrid: the other layers keep a fixed-size recurrent state
        attention_layers = layers // int(text["full_attention_interval"])
        note += f"; {attention_layers} of {layers} layers attend (hybrid)"
    return attention_layers * per_layer * element_bytes, note


def vision_model_type(config: dict) -> str | None:
    """The model type of a checkpoint with a vision tower (its images go through mlx-vlm), or None
    for a text-only one."""
    return config.get("model_type") if config.get("vision_config") else None
