"""`moe-mesh split`: the on-disk format, refusals, re-runs and Hugging Face layouts."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from services.common.manifest import RECORD_ALIGNMENT, Manifest
from services.common.model_build import expert_modules
from services.experts.store import read_records, records_to_weights
from services.tools.split import split_checkpoint
from services.tools.synthetic_model import build_random_checkpoint
from tests.helpers import run_cli

pytestmark = pytest.mark.slow  # starts processes or computes for seconds

DENSE_QWEN3 = {
    "model_type": "qwen3",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "vocab_size": 151936,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}


@pytest.mark.parametrize("bits", [None, 4], ids=["float32", "4bit"])
def test_layout_records_hold_each_expert(tiny_models, bits):
    import mlx_lm

    split = tiny_models.split("qwen3_moe", bits)
    manifest = Manifest.load(split)
    model, _ = mlx_lm.load(str(tiny_models.checkpoint("qwen3_moe", bits)))
    originals = dict(expert_modules(model))
    assert [layer.layer for layer in manifest.layers] == [0, 1, 2, 3]
    for layer in manifest.layers:
        path = split / layer.file
        assert path.name == f"layer_{layer.layer:03d}.bin"
        assert layer.record_size % RECORD_ALIGNMENT == 0
        assert path.stat().st_size == layer.num_experts * layer.record_size
        want = dict(tree_flatten(originals[layer.module].parameters()))
        got = records_to_weights(layer, read_records(split, layer, [5, 2]))
        assert sorted(got) == sorted(want)
        for name, array in got.items():
            assert array.dtype == want[name].dtype
            assert mx.array_equal(array, want[name][mx.array([5, 2])]).item(), name
    core = mx.load(str(split / "core" / "core.safetensors"))
    assert not [name for name in core if "switch_mlp" in name], "core must not hold routed-expert weights"
    assert (split / "core" / "tokenizer.json").exists() and (split / "core" / "config.json").exists()


def test_dense_checkpoint_is_refused_with_one_clear_line(tmp_path):
    source = build_random_checkpoint(tmp_path / "dense", DENSE_QWEN3)
    result = run_cli("split", str(source), str(tmp_path / "out"))
    assert result.returncode != 0
    assert "dense model: it has no routed experts" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_unknown_and_missing_checkpoints_are_refused(tmp_path):
    (tmp_path / "weird").mkdir()
    (tmp_path / "weird" / "config.json").write_text(json.dumps({"model_type": "no_such_arch"}))
    result = run_cli("split", str(tmp_path / "weird"), str(tmp_path / "out"))
    assert result.returncode != 0 and "'no_such_arch' is not an mlx-lm architecture" in result.stderr
    result = run_cli("split", str(tmp_path / "nothing"), str(tmp_path / "out"))
    assert result.returncode != 0 and "nothing: no such folder" in result.stderr
    (tmp_path / "empty").mkdir()
    result = run_cli("split", str(tmp_path / "empty"), str(tmp_path / "out"))
    assert result.returncode != 0 and "no config.json" in result.stderr
    for name, text, words in (
        ("broken", "{", "is not valid JSON"),
        ("listed", "[1]", "must hold a JSON object"),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(text)
        result = run_cli("split", str(tmp_path / name), str(tmp_path / "out"))
        assert result.returncode != 0 and words in result.stderr and "config.json" in result.stderr
        assert "Traceback" not in result.stderr
    assert "Traceback" not in result.stderr


def test_rerun_into_the_same_folder_is_safe(tiny_models, tmp_path):
    source = tiny_models.checkpoint("mixtral", None)
    first = split_checkpoint(source, tmp_path / "out", progress=False)
    (tmp_path / "out" / "experts" / "layer_000.bin").write_bytes(b"corrupt")  # a damaged earlier split
    second = split_checkpoint(source, tmp_path / "out", progress=False)
    assert first.fingerprint == second.fingerprint
    assert (tmp_path / "out" / "experts" / "layer_000.bin").stat().st_size == second.layers[0].file_size
    assert not list(tmp_path.glob(".out.partial-*"))
    # A folder that is not a split is never overwritten.
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a moe-mesh split"):
        split_checkpoint(source, tmp_path / "mine", progress=False)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    # nor one that merely has a manifest.json (a web app's), nor a split the user put files in
    (tmp_path / "webapp" / "src").mkdir(parents=True)
    (tmp_path / "webapp" / "manifest.json").write_text('{"name": "My PWA"}')
    with pytest.raises(ValueError, match="not a moe-mesh split"):
        split_checkpoint(source, tmp_path / "webapp", progress=False)
    assert (tmp_path / "webapp" / "src").is_dir()
    (tmp_path / "out" / "NOTES.txt").write_text("mine")
    with pytest.raises(ValueError, match="also holds NOTES.txt"):
        split_checkpoint(source, tmp_path / "out", progress=False)
    assert (tmp_path / "out" / "NOTES.txt").read_text() == "mine"


def test_hugging_face_per_expert_layout_splits_like_the_stacked_one(tiny_models, tmp_path):
    """Mixtral as Hugging Face ships it: experts.N.w1/w2/w3 — mlx-lm's sanitize() stacks them."""
    source = tiny_models.checkpoint("mixtral", None)
    hf = tmp_path / "hf"
    shutil.copytree(source, hf)
    weights = mx.load(str(source / "model.safetensors"))
    per_expert = {}
    names = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
    for key, value in weights.items():
        if ".switch_mlp." in key:
            prefix, rest = key.split(".switch_mlp.")
            proj, _ = rest.split(".")
            for e in range(value.shape[0]):
                per_expert[f"{prefix}.experts.{e}.{names[proj]}.weight"] = value[e]
        else:
            per_expert[key] = value
    (hf / "model.safetensors.index.json").unlink(missing_ok=True)
    mx.save_safetensors(str(hf / "model.safetensors"), per_expert, metadata={"format": "mlx"})

    stacked = split_checkpoint(source, tmp_path / "a", progress=False)
    from_hf = split_checkpoint(hf, tmp_path / "b", progress=False)
    assert [l.tensors for l in stacked.layers] == [l.tensors for l in from_hf.layers]
    for layer in stacked.layers:
        assert np.array_equal(
            np.fromfile(tmp_path / "a" / layer.file, dtype=np.uint8),
            np.fromfile(tmp_path / "b" / layer.file, dtype=np.uint8),
        )


def test_a_split_that_fails_leaves_nothing_beside_out(tiny_models, tmp_path, monkeypatch):
    """Whatever stops a split after it began writing (a refusal, a crash, Ctrl-C), nothing
    half-written stays beside OUT; and a staging folder a killed split left is removed by the
    next split into the same OUT."""
    from services.tools import split as split_module

    abandoned = tmp_path / ".out.partial-999999999"  # no such process
    (abandoned / "experts").mkdir(parents=True)

    def fail(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(split_module, "_activation_dtype", fail)  # after every layer is written
    with pytest.raises(KeyboardInterrupt):
        split_checkpoint(tiny_models.checkpoint("qwen3_moe", None), tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_split_stopped_by_a_signal_leaves_nothing_and_no_traceback(tiny_models, tmp_path, sig, code):
    """SIGTERM (a service manager, `kill`) cleans up as Ctrl-C does; both end in one line. The
    split runs in its own process and signals itself from inside, after every layer file is
    written: no race with a split that takes a fraction of a second."""
    script = (
        "import os, signal\n"
        # as in a terminal: a shell that started us in the background may have left SIGINT ignored
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from services.tools import split\n"
        "def midway(*args):\n"
        f"    os.kill(os.getpid(), {int(sig)})\n"
        "    raise AssertionError('the signal did not stop the split')\n"
        "split._activation_dtype = midway\n"
        "from services.ops.cli import main\n"
        f"main(['split', {str(tiny_models.checkpoint('qwen3_moe', None))!r}, {str(tmp_path / 'out')!r}])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == code, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []
