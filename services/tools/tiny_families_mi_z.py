"""Tiny configs of mlx-lm's MoE families from minimax to step3p5: what each needs beyond `SIZES` (see
`services/tools/moe_families.py`). Each switches its routed experts on and keeps the family's own
structure (dense first layers, interleaved layers, shared experts, hybrid attention) in 2-4 layers."""

from __future__ import annotations

from typing import Any

from services.tools.synthetic_model import TINY_CONFIGS

# Qwen's special token ids (vocabulary ids: bandit reads "token" keys as passwords)
QWEN_TOKEN_IDS = {"bos_token_id": 151643, "eos_token_id": 151645}  # nosec B105


# Qwen3.5's MoE text model, as synthetic_model's qwen3_5_moe has it, built on qwen3_moe's fields.
QWEN3_5_TEXT: dict[str, Any] = {
    **TINY_CONFIGS["qwen3_5_moe"]["text_config"],
    "family": "qwen3_moe",
    "rope_parameters": {
        "type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [1, 1, 0],
    },
    **QWEN_TOKEN_IDS,
}

CONFIGS: dict[str, dict[str, Any]] = {
    "minimax": {
        "intermediate_size": 32,
        "shared_intermediate_size": 32,
        "rotary_dim": 8,
        "scoring_func": "sigmoid",
        "use_qk_norm": True,
    },
    # Text model nests under text_config; its TextArgs live in minimax_m3_vl itself, so the
    # inner config starts from minimax's fields (TextArgs ignores the ones it lacks).
    # Layer 0 dense, layers 1-3 MoE with a shared expert; layers 1 and 3 use block-sparse
    # (indexer) attention with blocks small enough that the 16-token prompt drops some.
    "minimax_m3_vl": {
        "text_config": {
            "family": "minimax",
            "model_type": "minimax_m3_vl_text",
            **QWEN_TOKEN_IDS,
            "intermediate_size": 32,
            "dense_intermediate_size": 64,
            "shared_intermediate_size": 32,
            "head_dim": 16,
            "partial_rotary_factor": 0.5,
            "rotary_dim": 8,
            "routed_scaling_factor": 2.0,
            "use_qk_norm": True,
            "use_gemma_norm": True,
            "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
            "layer_types": ["full_attention", "minimax_m3_sparse", "full_attention", "minimax_m3_sparse"],
            "sparse_attention_config": {
                "sparse_num_index_heads": 2,
                "sparse_index_dim": 16,
                "sparse_block_size": 4,
                "sparse_topk_blocks": 2,
                "sparse_local_block": 1,
            },
        },
    },
    # MLA attention (kv_b absorbed), layer 0 dense, layers 1-3 MoE with a shared expert.
    # Yarn rope with the llama-4 query scaling; original_max_position_embeddings 16 so the
    # scale changes within the 16-token prompt + 8 generated tokens.
    "mistral4": {
        "num_key_value_heads": 4,
        "intermediate_size": 64,
        "head_dim": 24,
        "qk_head_dim": 24,
        "max_position_embeddings": 64,
        "rope_interleave": True,
        "rope_parameters": {
            "type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "max_position_embeddings": 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale_all_dim": 1.0,
            "mscale": 1.0,
            "llama_4_scaling_beta": 0.1,
            "partial_rotary_factor": 8 / 24,
        },
        **QWEN_TOKEN_IDS,
        "pad_token_id": QWEN_TOKEN_IDS["bos_token_id"],
    },
    # The vision-language wrapper around the MoE text model (mistral4).
    "mistral3": {
        "text_config": {"family": "mistral4"},
    },
    # TextArgs live in muse_spark itself; the inner config starts from mixtral's tiny one
    # (TextArgs ignores what it lacks). Sliding RoPE layers alternate with full NoPE layers
    # (layer_rope_theta 0), as the real model's pattern; the window (8) is shorter than the
    # prompt. Experts run at a compressed width (moe_hidden_size) between two projections.
    "muse_spark": {
        "text_config": {
            "family": "mixtral",
            "model_type": "muse_spark_text",
            "head_dim": 16,
            "post_norm_eps": 1e-8,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            "layer_rope_theta": [10000.0, 0, 10000.0, 0],
            "sliding_window": 8,
            "final_logit_softcapping": 20.0,
            "output_multiplier": 0.1767766952966369,
            "qk_scale_factor": 5.4730064863875,
            "moe_hidden_size": 32,
            "moe_intermediate_size": 32,
            "routed_scaling_factor": 1.0,
            "num_shared_experts": 0,
            "mlp_layer_types": ["sparse"] * 4,
            **QWEN_TOKEN_IDS,
        },
        "audio_config": {"out_hidden_size": 64},
    },
    # Mamba2 / MoE / attention / MoE hybrid (Nemotron-3 style), relu2 SwitchMLP experts with a
    # shared expert and sigmoid routing with a score-correction bias. (The latent-width variant
    # is covered by synthetic_model's nemotron_h_latent.)
    "nemotron_h": {
        "layers_block_type": ["linear_attention", "moe", "full_attention", "moe"],
        "intermediate_size": 64,
        "attention_bias": False,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "mamba_proj_bias": False,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "n_groups": 2,
        "mlp_bias": False,
        "use_bias": False,
        "use_conv_bias": True,
        **QWEN_TOKEN_IDS,
        "pad_token_id": QWEN_TOKEN_IDS["bos_token_id"],
    },
    # qwen3_5 is dense unless its text config has num_experts > 0 (then every layer is a
    # SparseMoeBlock with a gated shared expert). Gated-DeltaNet linear layers alternate with
    # full attention (full_attention_interval 2). Inner config starts from qwen3_moe's.
    "qwen3_5": {"text_config": {**QWEN3_5_TEXT, "model_type": "qwen3_5_text"}},
    # Gated-DeltaNet linear layers alternate with gated full attention (interval 2); layer 0
    # keeps a dense MLP (mlp_only_layers), the others are MoE with a gated shared expert.
    "qwen3_next": {
        **{
            k: v for k, v in QWEN3_5_TEXT.items() if k.startswith("linear_") or k == "full_attention_interval"
        },
        "intermediate_size": 64,
        "mlp_only_layers": [0],
        "partial_rotary_factor": 0.25,
        **QWEN_TOKEN_IDS,
    },
    # Vision-language wrapper around qwen3_moe; layer 0 keeps a dense MLP (mlp_only_layers).
    "qwen3_vl_moe": {
        "text_config": {
            "family": "qwen3_moe",
            "model_type": "qwen3_vl_moe_text",
            "mlp_only_layers": [0],
            **QWEN_TOKEN_IDS,
        },
    },
    # Step-3.5-Flash shape: layer 0 dense, 1-3 MoE with a shared expert and sigmoid routing with
    # a router bias; full/sliding attention alternate, sliding layers with their own head counts
    # (attention_other_setting), per-layer rope theta and partial rotary factor, yarn on full
    # layers only, head-wise attention gate, clamped SwiGLU on some layers.
    "step3p5": {
        "num_attention_groups": 2,
        "intermediate_size": 64,
        "layer_types": ["full_attention", "sliding_attention", "full_attention", "sliding_attention"],
        "sliding_window": 8,
        "attention_other_setting": {"num_attention_heads": 2, "num_attention_groups": 1},
        "rope_theta": [10000.0, 5000.0, 10000.0, 5000.0],
        "partial_rotary_factors": [0.5, 1.0, 0.5, 1.0],
        "yarn_only_types": ["full_attention"],
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 2.0,
            "original_max_position_embeddings": 2048,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
        "use_head_wise_attn_gate": True,
        "moe_top_k": 2,
        "share_expert_dim": 32,
        "moe_layers_enum": "1,2,3",
        "moe_router_scaling_factor": 3.0,
        "norm_expert_weight": True,
        "swiglu_limits": [0.0, 0.0, 7.0, 7.0],
        "swiglu_limits_shared": [0.0, 0.0, 0.0, 16.0],
        **QWEN_TOKEN_IDS,
    },
    # qwen3_5 (MoE text config, as above) whose listed Linear modules are 2-bit Hadamard-packed.
    # A packed module needs an input width divisible by 128 and a Hadamard block of 0 or
    # 512..8192 dividing it, so the shared experts are 512 wide inside: their down_proj (input
    # 512) is packed with block 512 (rotated) in layers 0 and 2, without rotation (block 0) in 1.
    "prism_hadamard_qwen35": {
        "text_config": {
            **QWEN3_5_TEXT,
            "model_type": "qwen3_5_moe_text",
            "shared_expert_intermediate_size": 512,
        },
        "schema_version": 2,
        "tensor_namespace": "mlx-vlm-qwen3_5",
        "gdn_activation_layout": "grouped",
        "quantization": {"bits": 2, "group_size": 128, "mode": "affine"},
        "modules": [
            {
                "path": f"model.layers.{i}.mlp.shared_expert.down_proj",
                "embedding": False,
                "dtype": "float16",
                "block": block,
            }
            for i, block in ((0, 512), (1, 0), (2, 512))
        ],
    },
}
