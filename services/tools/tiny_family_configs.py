"""Small sizes for tiny random checkpoints of mlx-lm's MoE families (see `moe_families`).

`SIZES` gives one value per `ModelArgs` field name, shared by every family; `FAMILY_CONFIGS`
gives what one family needs beyond it.
"""

from __future__ import annotations

from typing import Any

from services.tools.tiny_families_a_mi import CONFIGS as A_TO_MIMO
from services.tools.tiny_families_mi_z import CONFIGS as MINIMAX_TO_Z

SIZES: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 151936,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "layer_norm_epsilon": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "num_experts": 8,
    "num_local_experts": 8,
    "n_routed_experts": 8,
    "moe_num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_k": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
}

FAMILY_CONFIGS: dict[str, dict[str, Any]] = {**A_TO_MIMO, **MINIMAX_TO_Z}
