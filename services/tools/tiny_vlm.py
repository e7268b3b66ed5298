"""Tiny random MoE vision-language checkpoints, built with mlx-vlm, in the layout mlx-vlm saves.

Qwen3-VL-MoE has everything a real one has at toy sizes: a vision tower with DeepStack outputs, a
4-layer MoE language model (layer 0 dense), interleaved 3-D rotary positions, the Qwen3 tokenizer,
an image processor config, and a chat template that renders image parts. Qwen3.5-MoE adds Gated
DeltaNet layers. Kimi-VL has a MoonViT tower and DeepSeek-V3's language model (MLA attention,
sigmoid routing, a shared expert) with plain positions; its tokenizer is Qwen3's with Kimi's media
tokens added. MiniMax-M3-VL has a CLIP tower and MiniMax-M3's language model (block-sparse
attention, sigmoid routing with its shared expert packed into the expert bank); its processor wraps
each image in start and end markers. Llama 4 has chunked attention, top-1 experts and images cut
into tiles; GLM-4.5V has GLM-4.5's language model with 3-D positions; Step-3.7 has Step-3.5's
(sliding windows) and cuts large images into crops; Gemma 4's image positions attend to each other
both ways; DeepSeek-VL2 has a language model only mlx-vlm builds and tiles by the prompt's count of
images. (The configs of the families beyond Qwen's live
in tiny_vlm_families.py.) Tests and benches compare moe-mesh's answers on them with
`mlx_vlm.generate`'s.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten

from services.tools.synthetic_model import TINY_CONFIGS, qwen3_tokenizer_dir
from services.tools.tiny_families_mi_z import QWEN_TOKEN_IDS
from services.tools.tiny_vlm_families import (
    DEEPSEEK_VL_V2_CHAT_TEMPLATE,
    DEEPSEEK_VL_V2_CONFIG,
    DEEPSEEK_VL_V2_MEDIA_TOKENS,
    DEEPSEEK_VL_V2_PROCESSOR,
    DEEPSEEK_VL_V2_TOKENIZER,
    GEMMA4_MEDIA_TOKENS,
    GEMMA4_TOKEN_NAMES,
    GEMMA4_VL_CONFIG,
    GLM4V_MEDIA_TOKENS,
    GLM4V_MOE_CONFIG,
    KIMI_MEDIA_TOKENS,
    KIMI_VL_CONFIG,
    LLAMA4_MEDIA_TOKENS,
    LLAMA4_VL_CONFIG,
    MINIMAX_M3_VL_CONFIG,
    MINIMAX_MEDIA_TOKENS,
    QWEN_VOCAB,
    STEP3P7_CONFIG,
    STEP3P7_MEDIA_TOKENS,
)

# the Qwen3 tokenizer's vision tokens
VISION_TOKEN_IDS = {"image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652, "vision_end_token_id": 151653}  # nosec B105  # fmt: skip
TEXT = {
    "model_type": "qwen3_vl_moe_text",
    "num_hidden_layers": 4,
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [0],
    "moe_intermediate_size": 32,
    "rms_norm_eps": 1e-6,
    "vocab_size": 151936,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "norm_topk_prob": True,
    "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True},
    **QWEN_TOKEN_IDS,
}
VISION = {
    "model_type": "qwen3_vl_moe",
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "out_hidden_size": 64,
    "num_heads": 2,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 64,
    "deepstack_visual_indexes": [0],
    "in_channels": 3,
}
CONFIG = {
    "model_type": "qwen3_vl_moe",
    "text_config": TEXT,
    "vision_config": VISION,
    **VISION_TOKEN_IDS,
    "eos_token_id": QWEN_TOKEN_IDS["eos_token_id"],
    "tie_word_embeddings": False,
}
# Qwen3.5's natively multimodal MoE: Gated DeltaNet and full-attention layers, no DeepStack
QWEN3_5_CONFIG = {
    "model_type": "qwen3_5_moe",
    "text_config": {
        **{k: v for k, v in TINY_CONFIGS["qwen3_5_moe"]["text_config"].items() if k != "rope_theta"},
        "rope_parameters": {
            "type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [1, 1, 0],
            "mrope_interleaved": True,
        },
        **QWEN_TOKEN_IDS,
    },
    "vision_config": {**VISION, "model_type": "qwen3_5_moe", "deepstack_visual_indexes": []},
    **VISION_TOKEN_IDS,
    **QWEN_VOCAB,
}
FAMILIES = {
    "qwen3_vl_moe": CONFIG,
    "qwen3_5_moe": QWEN3_5_CONFIG,
    "kimi_vl": KIMI_VL_CONFIG,
    "minimax_m3_vl": MINIMAX_M3_VL_CONFIG,
    "llama4": LLAMA4_VL_CONFIG,
    "glm4v_moe": GLM4V_MOE_CONFIG,
    "step3p7": STEP3P7_CONFIG,
    "gemma4": GEMMA4_VL_CONFIG,
    "deepseek_vl_v2": DEEPSEEK_VL_V2_CONFIG,
}
ADDED_TOKENS = {
    "kimi_vl": KIMI_MEDIA_TOKENS,
    "minimax_m3_vl": MINIMAX_MEDIA_TOKENS,
    "llama4": LLAMA4_MEDIA_TOKENS,
    "glm4v_moe": GLM4V_MEDIA_TOKENS,
    "step3p7": STEP3P7_MEDIA_TOKENS,
    "gemma4": GEMMA4_MEDIA_TOKENS,
    "deepseek_vl_v2": DEEPSEEK_VL_V2_MEDIA_TOKENS,
}
# Embeddings a family's random model scales by 1 / sqrt(hidden): Gemma 4 multiplies its tied
# embeddings by sqrt(hidden) on the way in, where random ones would drown every layer's output
EMBEDDINGS_SCALED_IN = {"gemma4": "language_model.model.embed_tokens.weight"}
# tokens a family's processor finds by name in the tokenizer config
NAMED_TOKENS = {"gemma4": GEMMA4_TOKEN_NAMES}
# what a family's tokenizer config says beyond Qwen3's
TOKENIZER_SETTINGS = {"deepseek_vl_v2": DEEPSEEK_VL_V2_TOKENIZER}
# a family's own chat format, where the Qwen-style one is not its processor's
CHAT_TEMPLATES = {"deepseek_vl_v2": DEEPSEEK_VL_V2_CHAT_TEMPLATE}
# processors configured by processor_config.json
PROCESSOR_CONFIGS = {"deepseek_vl_v2": DEEPSEEK_VL_V2_PROCESSOR}
# 64 x 64 pixels (4 merged image tokens) up to 256 x 256 (64)
PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen3VLProcessor",
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "min_pixels": 4096,
    "max_pixels": 65536,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
# MiniMax-M3-VL's processor is mlx-vlm's own, named by the model type: 56 x 56 (4 merged tokens) up
# to 224 x 224 (64)
MINIMAX_PREPROCESSOR = {"patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 3136, "max_pixels": 50176}  # fmt: skip
# Kimi-VL's processor takes its sizes from config.json
PREPROCESSORS = {
    "qwen3_vl_moe": PREPROCESSOR,
    "qwen3_5_moe": PREPROCESSOR,
    "minimax_m3_vl": MINIMAX_PREPROCESSOR,
    # Hugging Face's GLM-4V image processor (14-pixel patches, merged 2 x 2): 56 x 56 up to 224 x 224
    "glm4v_moe": {
        "image_processor_type": "Glm4vImageProcessor",
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "size": {"shortest_edge": 3136, "longest_edge": 50176},
        "image_mean": [0.5] * 3,
        "image_std": [0.5] * 3,
    },
    # mlx-vlm's own Gemma 4 processor: 16-pixel patches pooled 3 x 3, at most 16 positions an image
    "gemma4": {"patch_size": 16, "max_soft_tokens": 16, "pooling_kernel_size": 3, "image_seq_length": 16},
    # mlx-vlm's own Llama 4 processor: up to four 56 x 56 tiles and the whole image
    "llama4": {
        "size": {"height": 56, "width": 56},
        "max_patches": 4,
        "image_mean": [0.5] * 3,
        "image_std": [0.5] * 3,
    },
}
# Qwen-VL's convention: an image part renders as one image token between the vision markers (Kimi-VL:
# one media pad between its media markers); the processor's count of positions replaces it.
CHAT_TEMPLATE = """{%- for message in messages %}
{{- '<|im_start|>' + message['role'] + '\\n' }}
{%- if message['content'] is string %}{{- message['content'] }}
{%- else %}{%- for part in message['content'] %}
{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part %}{{- 'IMAGE' }}
{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}
{%- endfor %}{%- endif %}
{{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
IMAGE_MARKUP = {
    "kimi_vl": "<|media_start|>image<|media_content|><|media_pad|><|media_end|>",
    "minimax_m3_vl": "]<]image[>[",  # its processor adds the start and end markers
    "llama4": "<|image|>",  # its processor writes the markers, tiles and separators
    "glm4v_moe": "<|begin_of_image|><|image|><|end_of_image|>",
    "step3p7": "<im_patch>",  # its processor writes the markers and crops
    "gemma4": "<|image|>",  # its processor writes the start and end around the image's positions
    None: "<|vision_start|><|image_pad|><|vision_end|>",
}


def build_tiny_vlm(
    out_dir: Path, seed: int = 0, sizes: dict | None = None, family: str = "qwen3_vl_moe"
) -> Path:
    """Write the checkpoint of `family` (FAMILIES) to `out_dir` (float32: MLX's CPU expert kernel
    takes float32); `sizes`: {"text": ..., "vision": ..., "config": ..., "projector": ..., "preprocessor": ...}
    overrides (tiny_vlm_bench_sizes.py)."""
    from services.common.vlm_language_models import build_vision_model

    sizes = sizes or {}
    config = json.loads(json.dumps(FAMILIES[family]))
    config["language_config" if "language_config" in config else "text_config"].update(sizes.get("text", {}))
    config["vision_config"].update(sizes.get("vision", {}))
    config.update(sizes.get("config", {}))
    if "projector" in sizes:
        config["projector_config"].update(sizes["projector"])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    model = build_vision_model(json.loads(json.dumps(config)))
    # doubled weights keep activations lively through random layers (as synthetic_model does)
    model.update(nn.utils.tree_map(lambda p: p * 2.0 if p.ndim > 1 else p, model.parameters()))
    weights = dict(tree_flatten(model.parameters()))
    for key, value in weights.items():  # routers mlx-vlm starts at zero would tie every expert
        if key.endswith(("mlp.gate.weight", "e_score_correction_bias")) and not mx.any(value).item():
            weights[key] = mx.random.normal(value.shape) * 0.5
    if family in EMBEDDINGS_SCALED_IN:
        key = EMBEDDINGS_SCALED_IN[family]
        weights[key] = weights[key] * config["text_config"]["hidden_size"] ** -0.5
    mx.eval(weights)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    if family in PREPROCESSORS:
        preprocessor = {**PREPROCESSORS[family], **sizes.get("preprocessor", {})}
        (out_dir / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=1))
    for path in qwen3_tokenizer_dir().iterdir():
        if path.is_file():
            shutil.copy(path, out_dir / path.name)
    if family in PROCESSOR_CONFIGS:
        processor = {**PROCESSOR_CONFIGS[family], **sizes.get("preprocessor", {})}
        (out_dir / "processor_config.json").write_text(json.dumps(processor, indent=1))
    if family in ADDED_TOKENS:
        _add_special_tokens(
            qwen3_tokenizer_dir(), out_dir, ADDED_TOKENS[family], NAMED_TOKENS.get(family, {})
        )
    if family in TOKENIZER_SETTINGS:
        config_path = out_dir / "tokenizer_config.json"
        config_path.write_text(
            json.dumps({**json.loads(config_path.read_text()), **TOKENIZER_SETTINGS[family]}, indent=1)
        )
    markup = IMAGE_MARKUP.get(family, IMAGE_MARKUP[None])
    template = CHAT_TEMPLATES.get(family) or CHAT_TEMPLATE.replace("'IMAGE'", repr(markup))
    (out_dir / "chat_template.jinja").write_text(template)
    return out_dir


def _add_special_tokens(source: Path, out_dir: Path, tokens: tuple[str, ...], named: dict[str, str]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(source))  # nosec B615  # a local folder: nothing downloads
    tokenizer.add_special_tokens({"additional_special_tokens": list(tokens)})
    tokenizer.save_pretrained(str(out_dir))
    if named:
        config_path = out_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["extra_special_tokens"] = named
        config_path.write_text(json.dumps(config, indent=1))
