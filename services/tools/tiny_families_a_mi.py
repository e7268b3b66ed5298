"""Tiny configs of mlx-lm's MoE families from Klear to mimo_v2_flash: what each needs beyond `SIZES` (see
`services/tools/moe_families.py`). Each switches its routed experts on and keeps the family's own
structure (dense first layers, interleaved layers, shared experts, hybrid attention) in 2-4 layers."""

from __future__ import annotations

from typing import Any

# Ling's linear-attention families: a full-attention layer every 2nd, a dense first layer, sigmoid
# grouped routing with an expert bias, a shared expert.
BAILING_LINEAR: dict[str, Any] = {
    "layer_group_size": 2,
    "group_norm_size": 4,
    "first_k_dense_replace": 1,
    "num_shared_experts": 1,
    "partial_rotary_factor": 0.5,
    "score_function": "sigmoid",
    "moe_router_enable_expert_bias": True,
    "n_group": 2,
    "topk_group": 1,
    "use_qk_norm": True,
}

# LongCat-Flash: 2 layers (each 2 MLA attention + 2 dense MLPs + a shortcut MoE), 8 routed +
# 4 zero (identity) experts, MLA LoRA scaling.
LONGCAT_FLASH: dict[str, Any] = {
    "attention_method": "MLA",
    "zero_expert_type": "identity",
    "ffn_hidden_size": 64,
    "moe_topk": 2,
    "expert_ffn_hidden_size": 32,
    "zero_expert_num": 4,
    "num_layers": 2,
    "mla_scale_q_lora": True,
    "mla_scale_kv_lora": True,
    "attention_bias": False,
    "routed_scaling_factor": 6.0,
}

CONFIGS: dict[str, dict[str, Any]] = {
    # Klear: shared expert mixed by a learned coefficient; first layer dense via mlp_only_layers.
    "Klear": {
        "attention_bias": False,
        "mlp_only_layers": [0],
        "decoder_sparse_step": 1,
        "n_shared_experts": 1,
    },
    # afmoe: sliding/full attention interleaved, 1 dense layer first, sigmoid routing + shared expert, muP.
    "afmoe": {
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "num_dense_layers": 1,
        "sliding_window": 8,
        "num_shared_experts": 1,
        "score_func": "sigmoid",
        "route_norm": True,
        "route_scale": 2.826,
        "mup_enabled": True,
    },
    # bailing_hybrid: linear-attention (GLA) layers with MLA every layer_group_size-th layer,
    # dense first layer, sigmoid grouped routing with expert bias, shared expert.
    "bailing_hybrid": BAILING_LINEAR,
    # bailing_moe_linear: linear-attention layers + full attention every 2nd layer, dense first layer,
    # sigmoid grouped routing with expert bias, shared expert.
    "bailing_moe_linear": {**BAILING_LINEAR, "head_dim": 16},
    # deepseek_v2: MLA with yarn rope, dense first layer, group-limited greedy routing, shared expert.
    "deepseek_v2": {
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_shared_experts": 1,
        "topk_method": "group_limited_greedy",
        "n_group": 2,
        "topk_group": 1,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        "attention_bias": False,
    },
    # ernie4_5_moe: dense first layer (moe_layer_start_index), shared expert.
    "ernie4_5_moe": {
        "use_bias": False,
        "moe_layer_start_index": 1,
        "moe_layer_interval": 1,
        "moe_num_shared_experts": 1,
        "moe_gate_act": "softmax",
    },
    # exaone_moe: 3 sliding : 1 full attention, dense first layer, sigmoid noaux_tc routing, shared expert.
    "exaone_moe": {
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        "is_moe_layer": [False, True, True, True],
        "num_shared_experts": 1,
        "routed_scaling_factor": 2.5,
    },
    # gemma4_text (26B-A4B style): dense MLP + routed experts in parallel in every layer,
    # sliding/full attention with K=V on full layers, tied embeddings, logit softcap.
    "gemma4_text": {
        "enable_moe_block": True,
        "num_experts": 8,
        "top_k_experts": 2,
        "moe_intermediate_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "global_head_dim": 32,
        "attention_k_eq_v": True,
        "num_global_key_value_heads": 1,
        "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": 151936,
        "sliding_window": 8,
        "sliding_window_pattern": 4,
        "layer_types": [
            "sliding_attention",
            "sliding_attention",
            "sliding_attention",
            "full_attention",
        ],  # last must be full (transformers)
        "use_double_wide_mlp": False,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
    },
    # gemma4: the multimodal wrapper around gemma4_text; outer vocab_size is copied into text_config.
    "gemma4": {
        "text_config": {"family": "gemma4_text"},
        "vocab_size": 151936,
    },
    # glm4_moe: partial rotary, qk-norm, attention bias, dense first layer, sigmoid noaux_tc + shared expert.
    "glm4_moe": {
        "rope_scaling": None,
        "use_qk_norm": True,
        "attention_bias": True,
        "partial_rotary_factor": 0.5,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "n_shared_experts": 1,
    },
    # glm_moe_dsa: deepseek_v32 (MLA + DSA indexer) body; index_topk < prompt length so the sparse
    # attention path is taken; dense first layer, sigmoid noaux_tc routing, shared expert.
    "glm_moe_dsa": {
        "index_head_dim": 16,
        "index_n_heads": 2,
        "index_topk": 8,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "moe_layer_freq": 1,
        "first_k_dense_replace": 1,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "attention_bias": False,
        "routed_scaling_factor": 2.5,
    },
    # granitemoehybrid (Granite 4.0-H): mamba2 layers + one attention layer (NoPE), MoE + shared MLP
    # in every layer, muP multipliers, tied embeddings.
    "granitemoehybrid": {
        "layer_types": ["mamba", "mamba", "attention", "mamba"],
        "attention_bias": False,
        "embedding_multiplier": 12.0,
        "attention_multiplier": 0.0625,
        "logits_scaling": 4.0,
        "residual_multiplier": 0.22,
        "intermediate_size": 32,
        "shared_intermediate_size": 64,
        "mamba_n_heads": 8,  # n_heads * d_head == mamba_expand(2) * hidden (transformers check)
        "mamba_d_head": 16,
        "mamba_proj_bias": False,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_n_groups": 1,
        "mamba_conv_bias": True,
        "position_embedding_type": "nope",
        "tie_word_embeddings": True,
    },
    # Hunyuan: every layer MoE, mixed shared MLP, qk-norm, cross-layer KV sharing (CLA) on
    # layers 1 and 3, NTK-alpha RoPE.
    "hunyuan": {
        "attention_bias": False,
        "moe_topk": 2,
        "num_shared_expert": 1,
        "use_mixed_mlp_moe": True,
        "use_qk_norm": True,
        "use_cla": True,
        "cla_share_factor": 2,
        "rope_scaling": {"alpha": 1000.0, "factor": 1.0, "type": "dynamic"},
    },
    # Jamba: mamba/attention interleave [M, A, M, A], MoE on layers 1 and 3 (dense 0 and 2).
    "jamba": {
        "attn_layer_offset": 1,
        "attn_layer_period": 2,
        "expert_layer_offset": 1,
        "expert_layer_period": 2,
        "mamba_d_conv": 4,
        "mamba_d_state": 16,
        "mamba_expand": 2,
    },
    # Kimi K2.5: DeepSeek-V3 text model (MLA, shared expert, dense first layer) in a VL wrapper.
    "kimi_k25": {
        "text_config": {"family": "deepseek_v3", "scoring_func": "sigmoid", "topk_method": "noaux_tc"}
    },
    # Kimi-VL: DeepSeek-V3-style text model in a VL wrapper (own TextArgs), 2 shared experts.
    "kimi_vl": {
        "text_config": {
            "family": "deepseek_v3",
            "n_shared_experts": 2,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "moe_layer_freq": 1,
        }
    },
    # Kimi Linear: KDA (linear) layers 1,2,4 (1-based) + MLA layer 3; dense layer 0, MoE 1-3,
    # shared expert, sigmoid router with score-correction bias.
    "kimi_linear": {
        "linear_attn_config": {
            "kda_layers": [1, 2, 4],
            "num_heads": 4,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
        },
        "model_max_length": 4096,
        # a top-k (bandit reads "token" keys as passwords)
        "num_experts_per_token": 2,  # nosec B105
        "num_shared_experts": 1,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "mla_use_nope": True,
        "moe_router_activation_func": "sigmoid",
        "num_expert_group": 1,
        "topk_group": 1,
    },
    # Kimi K3: Kimi-Linear-style text model (KDA + NoPE MLA) in a wrapper, with SiTU activation,
    # latent routed experts (64 -> 32), attention residuals (blocks of 2), q-LoRA and output gate.
    "kimi_k3": {
        "text_config": {
            "family": "kimi_linear",
            "model_type": "kimi_linear",
            "linear_attn_config": {
                "kda_layers": [1, 2, 4],
                "num_heads": 4,
                "head_dim": 16,
                "short_conv_kernel_size": 4,
            },
            "hidden_act": "situ",
            "mla_use_nope": True,
            "mla_use_output_gate": True,
            "q_lora_rank": 32,
            "routed_expert_hidden_size": 32,
            "latent_moe_use_norm": True,
            "attn_res_block_size": 2,
        }
    },
    # LFM2-MoE: short-conv / attention hybrid [C, A, C, A], dense first layer, expert bias.
    "lfm2_moe": {
        "use_expert_bias": True,
        "num_dense_layers": 1,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "layer_types": ["conv", "full_attention", "conv", "full_attention"],
    },
    # Llama 4 text model (own TextArgs) in the VL wrapper: MoE on layers 1 and 3 (interleave 2),
    # top-1 (mlx-lm supports only 1) + shared expert, chunked attention (chunk 8) on layers 0-2,
    # global NoPE attention on layer 3.
    "llama4": {
        "text_config": {
            "family": "llama4_text",
            "model_type": "llama4_text",
            "attention_bias": False,
            "attention_chunk_size": 8,
            "floor_scale": 4,
            "interleave_moe_layer_step": 2,
            "intermediate_size": 32,
            "intermediate_size_mlp": 64,
            "num_local_experts": 8,
            "num_experts_per_tok": 1,
            "max_position_embeddings": 16384,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "use_qk_norm": True,
        }
    },
    # Not an MoE family: the base of llama4's text_config (its required fields SIZES lacks).
    "llama4_text": {"intermediate_size_mlp": 64, "no_rope_layers": [1, 1, 1, 0], "use_qk_norm": True},
    "longcat_flash": LONGCAT_FLASH,
    # LongCat-Flash n-gram: as longcat_flash plus n-gram embeddings, kept small (ratio 1,
    # 3-grams, 2 splits -> 4 embedders of width 16).
    "longcat_flash_ngram": {
        **LONGCAT_FLASH,
        "ngram_vocab_size_ratio": 1,
        "emb_neighbor_num": 3,
        "emb_split_num": 2,
    },
    # Mellum: every layer MoE, sliding/full attention interleave with per-type RoPE.
    "mellum": {
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {
            "full_attention": {"rope_theta": 1000000.0, "rope_type": "default"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
    },
    # MiMo-V2-Flash: [full, SWA, SWA, full] attention with SWA sink bias, distinct K/V head dims,
    # partial RoPE, value scale; dense first layer then MoE (sigmoid noaux_tc, no shared experts).
    "mimo_v2_flash": {
        "hybrid_layer_pattern": [0, 1, 1, 0],
        "moe_layer_freq": [0, 1, 1, 1],
        "add_swa_attention_sink_bias": True,
        "add_full_attention_sink_bias": False,
        "sliding_window_size": 8,
        "n_shared_experts": None,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "swa_rope_theta": 10000.0,
        "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 2,
        "head_dim": 24,
        "v_head_dim": 16,
        "swa_head_dim": 24,
        "swa_v_head_dim": 16,
        "partial_rotary_factor": 0.334,
        "attention_value_scale": 0.707,
        "layernorm_epsilon": 1e-5,
    },
}
