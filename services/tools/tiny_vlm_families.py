"""Tiny random vision-language checkpoints of the families beyond Qwen's, configs only (tiny_vlm.py
builds them): Kimi-VL, MiniMax-M3-VL, Llama 4, GLM-4.5V, Step-3.7, Gemma 4 and DeepSeek-VL2, each at toy sizes with the layout and
tokens its mlx-vlm model and processor take. Their tokenizer is Qwen3's with the family's image
tokens added."""

from __future__ import annotations

from services.tools.moe_families import tiny_config
from services.tools.synthetic_model import TINY_CONFIGS
from services.tools.tiny_families_mi_z import QWEN_TOKEN_IDS

# The Qwen3 tokenizer's vocabulary and end of turn, which every tiny vision-language model speaks
QWEN_VOCAB = {
    "vocab_size": 151936,
    "eos_token_id": QWEN_TOKEN_IDS["eos_token_id"],
    "tie_word_embeddings": False,
}

# Kimi-VL's media tokens, added to the Qwen3 tokenizer (Kimi's own is tiktoken remote code)
KIMI_MEDIA_TOKENS = ("<|media_start|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>")
KIMI_VL_CONFIG = {
    "model_type": "kimi_vl",
    "text_config": {
        "model_type": "deepseek_v3",
        "vocab_size": 151936,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_shared_experts": 1,
        "n_routed_experts": 8,
        "routed_scaling_factor": 2.446,
        "kv_lora_rank": 32,
        "q_lora_rank": None,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "qk_nope_head_dim": 16,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "num_experts_per_tok": 2,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 1,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "tie_word_embeddings": False,
    },
    "vision_config": {
        "model_type": "moonvit",
        "depth": 2,
        "embed_dim": 32,
        "hidden_size": 32,
        "num_heads": 2,
        "patch_size": 14,
        "intermediate_size": 64,
        "init_pos_emb_height": 16,
        "init_pos_emb_width": 16,
        "merge_kernel_size": [2, 2],
    },
    "media_placeholder_token_id": 151672,  # nosec B105  # a token id: <|media_pad|> once KIMI_MEDIA_TOKENS are added
    **QWEN_VOCAB,
}
# MiniMax-M3-VL's image markers, added to the Qwen3 tokenizer after Qwen's own tokens
MINIMAX_MEDIA_TOKENS = ("]<]image[>[", "]<]video[>[", "]<]start of image[>[", "]<]end of image[>[")
# their ids once added
MINIMAX_TOKEN_IDS = {"image_token_index": 151669, "video_token_index": 151670, "vision_start_token_id": 151671, "vision_end_token_id": 151672}  # nosec B105  # fmt: skip
MINIMAX_M3_VL_CONFIG = {
    "model_type": "minimax_m3_vl",
    # mlx-lm's tiny MiniMax-M3 (dense layer 0, block-sparse attention on alternate layers), its
    # blocks wide enough that every test prompt attends to all of itself: mlx-lm and mlx-vlm pick
    # different blocks once a prompt outgrows them
    "text_config": {
        **tiny_config("minimax_m3_vl")["text_config"],
        "model_type": "minimax_m3",
        "sparse_attention_config": {
            "sparse_num_index_heads": 2,
            "sparse_index_dim": 16,
            "sparse_block_size": 128,
            "sparse_topk_blocks": 2,
            "sparse_local_block": 1,
        },
    },
    "vision_config": {
        "model_type": "clip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_hidden_layers": 2,
        "patch_size": 14,
        "image_size": 224,
        "projection_dim": 64,
    },
    "projector_hidden_size": 64,
    "img_token_compression_config": {"spatial_merge_size": 2, "temporal_patch_size": 2},
    **MINIMAX_TOKEN_IDS,
    **QWEN_VOCAB,
}
# Llama 4's image tokens, added to the Qwen3 tokenizer after Qwen's own; an image's positions are
# its `<|patch|>` tokens
LLAMA4_MEDIA_TOKENS = ("<|image_start|>", "<|image|>", "<|patch|>", "<|tile_x_separator|>", "<|tile_y_separator|>", "<|image_end|>")  # nosec B105  # fmt: skip
LLAMA4_VL_CONFIG = {
    "model_type": "llama4",
    "text_config": {**TINY_CONFIGS["llama4"]["text_config"], "eos_token_id": QWEN_TOKEN_IDS["eos_token_id"]},
    # 56 x 56 tiles of 14-pixel patches, four patches to a position after the pixel shuffle
    "vision_config": {
        "model_type": "llama4_vision_model",
        "hidden_size": 32,
        "image_size": 56,
        "initializer_range": 0.02,
        "intermediate_size": 128,  # the pixel shuffle's width: four patches of 32
        "norm_eps": 1e-5,
        "num_attention_heads": 2,
        "num_channels": 3,
        "num_hidden_layers": 2,
        "patch_size": 14,
        "pixel_shuffle_ratio": 0.5,
        "projector_dropout": 0.0,
        "projector_input_dim": 64,
        "projector_output_dim": 64,
        "rope_theta": 10000,
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "default",
        "vision_output_dim": 64,
    },
    "image_token_index": 151671,  # nosec B105  # a token id: <|patch|> once LLAMA4_MEDIA_TOKENS are added
    **QWEN_VOCAB,
}
# GLM-4.5V's image tokens, added to the Qwen3 tokenizer after Qwen's own
GLM4V_MEDIA_TOKENS = ("<|begin_of_image|>", "<|end_of_image|>", "<|image|>", "<|video|>")  # nosec B105
GLM4V_TOKEN_IDS = {"vision_start_token_id": 151669, "vision_end_token_id": 151670, "image_token_id": 151671, "image_token_index": 151671, "video_token_id": 151672, "video_token_index": 151672}  # nosec B105  # fmt: skip
GLM4V_MOE_CONFIG = {
    "model_type": "glm4v_moe",
    # GLM-4.5's language model: a dense first layer, sigmoid routing with a shared expert, biased
    # attention, half of each head rotated over three position axes
    "text_config": {
        "model_type": "glm4v_moe_text",
        "vocab_size": 151936,
        "hidden_size": 64,
        "intermediate_size": 128,
        "max_position_embeddings": 4096,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "n_group": 1,
        "topk_group": 1,
        "n_shared_experts": 1,
        "n_routed_experts": 8,
        "routed_scaling_factor": 1.0,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "num_hidden_layers": 3,
        "rms_norm_eps": 1e-5,
        "use_qk_norm": False,
        "attention_bias": True,
        "partial_rotary_factor": 0.5,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "default", "mrope_section": [2, 1, 1]},
        "tie_word_embeddings": False,
    },
    "vision_config": {
        "model_type": "glm4v_moe",
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": 14,
        "image_size": 56,
        "out_hidden_size": 64,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
    **GLM4V_TOKEN_IDS,
    "hidden_size": 64,
    **QWEN_VOCAB,
    "tie_word_embeddings": True,  # as Gemma's: the output head is the embeddings
}
# Step-3.7's image tokens, added to the Qwen3 tokenizer after Qwen's own; an image's positions are
# its `<im_patch>` tokens, those of its crops between patch markers
STEP3P7_MEDIA_TOKENS = ("<im_patch>", "<im_start>", "<im_end>", "<patch_start>", "<patch_end>", "<patch_newline>")  # nosec B105  # fmt: skip
STEP3P7_CONFIG = {
    "model_type": "step3p7",
    # Step-3.5's language model: sliding-window layers, head-wise attention gates, sigmoid routing
    "text_config": tiny_config("step3p5"),
    # a Perception Encoder at the processor's fixed sizes (728-pixel image, 504-pixel crops, 14-pixel
    # patches), two 2x downsamplers to the projector
    "vision_config": {
        "model_type": "perception_encoder",
        "width": 32,
        "layers": 2,
        "heads": 2,
        "mlp_ratio": 2.0,
        "image_size": 728,
        "patch_size": 14,
    },
    "image_token_id": 151669,  # nosec B105  # a token id: <im_patch> once STEP3P7_MEDIA_TOKENS are added
    **QWEN_VOCAB,
}
# Gemma 4's image tokens (start, image, end), added to the Qwen3 tokenizer after Qwen's own and named
# in its tokenizer config, where Gemma 4's processor looks them up
GEMMA4_MEDIA_TOKENS = ("<|image>", "<|image|>", "<image|>")  # nosec B105
GEMMA4_TOKEN_NAMES = dict(zip(("boi_token", "image_token", "eoi_token"), GEMMA4_MEDIA_TOKENS, strict=True))
GEMMA4_VL_CONFIG = {
    "model_type": "gemma4",
    # the 26B-A4B layout: dense MLP and routed experts side by side in every layer, sliding-window
    # layers with a full-attention one, image positions attending to each other both ways
    # (rotary settings spelled out, as released configs have them: mlx-lm's and mlx-vlm's defaults differ)
    "text_config": {
        **tiny_config("gemma4")["text_config"],
        "use_bidirectional_attention": "vision",
        "rope_parameters": {
            "full_attention": {
                "partial_rotary_factor": 0.25,
                "rope_theta": 1000000.0,
                "rope_type": "proportional",
            },
            "sliding_attention": {
                "partial_rotary_factor": 1.0,
                "rope_theta": 10000.0,
                "rope_type": "default",
            },
        },
    },
    # 16-pixel patches, pooled 3 x 3 into one position
    "vision_config": {
        "model_type": "gemma4_vision",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "global_head_dim": 16,
        "patch_size": 16,
        "pooling_kernel_size": 3,
        "position_embedding_size": 1024,
        "default_output_length": 16,
    },
    "boi_token_id": 151669,  # nosec B105  # token ids: GEMMA4_MEDIA_TOKENS once added
    "image_token_id": 151670,
    "eoi_token_id": 151671,
    "vision_soft_tokens_per_image": 16,
    "hidden_size": 64,
    **QWEN_VOCAB,
    "tie_word_embeddings": True,  # as Gemma's: the output head is the embeddings
}
# DeepSeek-VL2's image, grounding and chat tokens, added to the Qwen3 tokenizer after Qwen's own (its
# processor adds those the tokenizer lacks), and its start of text, which its processor puts first
# (not Qwen's <|endoftext|>: mlx-vlm masks the padding token out of the prompt, wherever it stands)
DEEPSEEK_VL_V2_BOS = "<｜begin▁of▁sentence｜>"  # nosec B105
DEEPSEEK_VL_V2_MEDIA_TOKENS = ("<image>", "<|ref|>", "<|/ref|>", "<|det|>", "<|/det|>", "<|grounding|>", "<|User|>", "<|Assistant|>", DEEPSEEK_VL_V2_BOS)  # nosec B105  # fmt: skip
DEEPSEEK_VL_V2_TOKENIZER = {"bos_token": DEEPSEEK_VL_V2_BOS}
# the format of DeepSeek-VL2's processor, from a start of text, each image on a line of its own
DEEPSEEK_VL_V2_CHAT_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
{%- if message['role'] == 'user' %}{{- '<|User|>:' }}{%- elif message['role'] == 'assistant' %}{{- '<|Assistant|>' }}{%- endif %}
{{- ' ' }}
{%- if message['content'] is string %}{{- message['content'] }}
{%- else %}{%- for part in message['content'] %}
{%- if part['type'] == 'image' %}{{- '<image>\n' }}{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}
{%- endfor %}{%- endif %}
{{- '\n\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|Assistant|>:' }}{%- endif %}"""
# its processor's tiles: a 32-pixel global view, and the image cut into up to 2 x 2 more
DEEPSEEK_VL_V2_PROCESSOR = {
    "candidate_resolutions": [[32, 32], [32, 64], [64, 32], [64, 64]],
    "patch_size": 16,
    "downsample_ratio": 2,
    "image_token": "<image>",  # nosec B105
}
DEEPSEEK_VL_V2_CONFIG = {
    "model_type": "deepseek_vl_v2",
    # DeepSeek-V2's language model as DeepSeek-VL2-Tiny has it: plain multi-head attention (no
    # latent: `qk_nope_head_dim` 0), a dense first layer, softmax routing with two shared experts;
    # under the name Hugging Face's config gives it
    "language_config": {
        "model_type": "deepseek_v2",
        "vocab_size": 151936,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_shared_experts": 2,
        "n_routed_experts": 8,
        "routed_scaling_factor": 1.0,
        "kv_lora_rank": 32,
        "q_lora_rank": None,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "qk_nope_head_dim": 0,
        "topk_method": "greedy",
        "scoring_func": "softmax",
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "rms_norm_eps": 1e-6,
    },
    # a SigLIP tower on 32-pixel tiles of 16-pixel patches, projected 2 x 2 down into the language model
    "vision_config": {
        "model_type": "vision",
        "layers": 2,
        "width": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "image_size": 32,
        "patch_size": 16,
        "mlp_ratio": 2.0,
    },
    "projector_config": {"input_dim": 32, "n_embed": 64, "downsample_ratio": 2},
    "tile_tag": "2D",
    "global_view_pos": "head",
    "image_token_index": 151669,  # nosec B105  # a token id: <image> once added
    **QWEN_VOCAB,
}
