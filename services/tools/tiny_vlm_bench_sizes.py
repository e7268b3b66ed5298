"""The tiny vision-language checkpoints at bench sizes (bench/vision.py builds them with
`build_tiny_vlm(sizes=FAMILY_BENCH_SIZES[family])`): a language model and a vision tower whose costs
show, in each family's layout, with random weights."""

from __future__ import annotations

# The language model's depth and widths most families' bench sizes share
BENCH_LANGUAGE_MODEL = {"num_hidden_layers": 8, "hidden_size": 1024, "intermediate_size": 2048}
# A larger one for benches: a vision tower whose cost shows beside the language model's
BENCH_SIZES = {
    "text": {
        **BENCH_LANGUAGE_MODEL,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "num_experts": 32,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 512,
        "rope_scaling": {"rope_type": "default", "mrope_section": [16, 8, 8], "mrope_interleaved": True},
    },
    "vision": {
        "depth": 12,
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_heads": 12,
        "out_hidden_size": 1024,
        "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [3, 6, 9],
    },
    "preprocessor": {"max_pixels": 448 * 448},
}
# Qwen3.5-MoE at bench sizes: Gated DeltaNet layers, full attention every fourth layer (as the
# released models), a quarter of each attention head rotated; the same vision tower without DeepStack
BENCH_SIZES_QWEN3_5 = {
    "text": {
        **{k: v for k, v in BENCH_SIZES["text"].items() if k != "rope_scaling"},
        "shared_expert_intermediate_size": 512,
        "linear_num_value_heads": 16,
        "linear_num_key_heads": 8,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "full_attention_interval": 4,
        "rope_parameters": {
            "type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [3, 3, 2],
            "mrope_interleaved": True,
        },
    },
    "vision": {**BENCH_SIZES["vision"], "deepstack_visual_indexes": []},
    "preprocessor": BENCH_SIZES["preprocessor"],
}
# Kimi-VL at bench sizes: MLA attention over a 256-wide latent, a 12-block MoonViT tower
BENCH_SIZES_KIMI_VL = {
    "text": {
        **BENCH_LANGUAGE_MODEL,
        "moe_intermediate_size": 512,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "n_routed_experts": 32,
        "num_experts_per_tok": 4,
        "kv_lora_rank": 256,
        "qk_rope_head_dim": 32,
        "qk_nope_head_dim": 64,
        "v_head_dim": 64,
    },
    "vision": {
        "depth": 12,
        "embed_dim": 768,
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_heads": 12,
        "init_pos_emb_height": 64,
        "init_pos_emb_width": 64,
    },
}
# MiniMax-M3-VL at bench sizes: a 12-layer CLIP tower, block-sparse attention on alternate layers
# (128-token blocks: a bench prompt fills two, so each attends to all of itself)
BENCH_SIZES_MINIMAX_M3_VL = {
    "text": {
        "num_hidden_layers": 8,
        "hidden_size": 1024,
        "intermediate_size": 512,
        "shared_intermediate_size": 512,
        "dense_intermediate_size": 2048,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "rotary_dim": 32,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "mlp_layer_types": ["dense"] + ["sparse"] * 7,
        "layer_types": ["full_attention", "minimax_m3_sparse"] * 4,
    },
    "vision": {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_attention_heads": 12,
        "num_hidden_layers": 12,
        "projection_dim": 1024,
    },
    "config": {"projector_hidden_size": 1024},
    "preprocessor": {"max_pixels": 448 * 448},
}
# Llama 4 at bench sizes, Scout's layout: every layer MoE (top-1 of 32), chunks of 8,192 positions,
# a 12-layer vision tower on 336-pixel tiles (144 positions each)
BENCH_SIZES_LLAMA4 = {
    "text": {
        "num_hidden_layers": 8,
        "hidden_size": 1024,
        "intermediate_size": 512,
        "intermediate_size_mlp": 2048,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "num_local_experts": 32,
        "interleave_moe_layer_step": 1,
        "attention_chunk_size": 8192,
        "floor_scale": 8192,
    },
    "vision": {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_attention_heads": 12,
        "num_hidden_layers": 12,
        "image_size": 336,
        "projector_input_dim": 1024,
        "projector_output_dim": 1024,
        "vision_output_dim": 1024,
    },
    "preprocessor": {"size": {"height": 336, "width": 336}, "max_patches": 16},
}
# GLM-4.5V at bench sizes: GLM-4.5's language model (a dense first layer, sigmoid routing with a
# shared expert, half of each head rotated over three position axes), a 12-block tower as Qwen's
BENCH_SIZES_GLM4V_MOE = {
    "text": {
        **BENCH_LANGUAGE_MODEL,
        "moe_intermediate_size": 512,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "n_routed_experts": 32,
        "num_experts_per_tok": 4,
        "rope_scaling": {"type": "default", "mrope_section": [4, 6, 6]},
    },
    "vision": {
        "depth": 12,
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_heads": 12,
        "image_size": 336,
        "out_hidden_size": 1024,
    },
    "config": {"hidden_size": 1024},
    "preprocessor": {"size": {"shortest_edge": 56 * 56, "longest_edge": 448 * 448}},
}
# Step-3.7 at bench sizes: Step-3.5's language model (full and 512-position sliding attention in
# turn, a dense first layer), a 12-layer Perception Encoder at the processor's fixed 728 pixels
BENCH_SIZES_STEP3P7 = {
    "text": {
        **BENCH_LANGUAGE_MODEL,
        "num_attention_heads": 16,
        "num_attention_groups": 4,
        "head_dim": 64,
        "layer_types": ["full_attention", "sliding_attention"] * 4,
        "sliding_window": 512,
        "attention_other_setting": {"num_attention_heads": 16, "num_attention_groups": 4},
        "rope_theta": [10000.0, 5000.0] * 4,
        "partial_rotary_factors": [0.5, 1.0] * 4,
        "moe_num_experts": 32,
        "moe_top_k": 4,
        "moe_intermediate_size": 512,
        "share_expert_dim": 512,
        "moe_layers_enum": "1,2,3,4,5,6,7",
        "swiglu_limits": [0.0] * 8,
        "swiglu_limits_shared": [0.0] * 8,
    },
    "vision": {"width": 768, "layers": 12, "heads": 12, "mlp_ratio": 4.0},
}
# Gemma 4 at bench sizes, 26B-A4B's layout: dense MLP and 32 experts (top-4) side by side in every
# layer, five 1,024-position sliding-window layers to one full-attention layer, a 12-layer tower whose
# 16-pixel patches pool 3 x 3 into at most 280 positions an image
BENCH_SIZES_GEMMA4 = {
    "text": {
        **BENCH_LANGUAGE_MODEL,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "global_head_dim": 128,
        "num_global_key_value_heads": 2,
        "num_experts": 32,
        "top_k_experts": 4,
        "moe_intermediate_size": 512,
        "sliding_window": 1024,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) + ["sliding_attention"] * 2,
    },
    "vision": {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 12,
        "head_dim": 64,
        "global_head_dim": 64,
        "position_embedding_size": 10240,
        "default_output_length": 280,
    },
    "config": {"hidden_size": 1024, "vision_soft_tokens_per_image": 280},
    "preprocessor": {"max_soft_tokens": 280, "image_seq_length": 280},
}
# DeepSeek-VL2 at bench sizes, Tiny's layout (plain attention, 64 experts of which 6 and 2 shared, a
# dense first layer), a 12-layer tower on 384-pixel tiles of 16-pixel patches (144 positions a tile
# after the projector's 2 x 2 downsampling): a 448 x 336 image is its global view and two tiles
BENCH_SIZES_DEEPSEEK_VL_V2 = {
    "text": {
        **BENCH_LANGUAGE_MODEL,
        "moe_intermediate_size": 512,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "n_routed_experts": 64,
        "num_experts_per_tok": 6,
    },
    "vision": {
        "layers": 12,
        "width": 768,
        "intermediate_size": 3072,
        "num_attention_heads": 12,
        "image_size": 384,
    },
    "projector": {"input_dim": 768, "n_embed": 1024},
    "preprocessor": {"candidate_resolutions": [[384, 384], [384, 768], [768, 384], [768, 768]]},
}
FAMILY_BENCH_SIZES = {
    "qwen3_vl_moe": BENCH_SIZES,
    "qwen3_5_moe": BENCH_SIZES_QWEN3_5,
    "kimi_vl": BENCH_SIZES_KIMI_VL,
    "minimax_m3_vl": BENCH_SIZES_MINIMAX_M3_VL,
    "llama4": BENCH_SIZES_LLAMA4,
    "glm4v_moe": BENCH_SIZES_GLM4V_MOE,
    "step3p7": BENCH_SIZES_STEP3P7,
    "gemma4": BENCH_SIZES_GEMMA4,
    "deepseek_vl_v2": BENCH_SIZES_DEEPSEEK_VL_V2,
}
