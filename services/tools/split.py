"""`moe-mesh split MODEL OUT`: cut an mlx-lm checkpoint into core weights and expert records.

The checkpoint is read with mlx-lm's own `load_model` (lazily): its `sanitize()`
turns Hugging Face per-expert layouts into the stacked `switch_mlp` layout and its
quantization logic applies, so whatever mlx-lm can load, we can split. Routed-expert
tensors (every parameter under a SwitchGLU/SwitchMLP module, leading dim = experts)
go to `experts/layer_NNN.bin` as fixed-size records; everything else goes to
`core/core.safetensors`.

The output is built in a sibling temp folder and swapped in at the end, so an
interrupted or repeated split never leaves a half-written folder behind.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model

from services.common import tensor_codec
from services.common.checkpoint_layouts import model_classes
from services.common.logging import get_logger
from services.common.manifest import Manifest, ManifestError, MoeLayer, record_layout
from services.common.model_build import (
    UnsupportedModelError,
    check_batchable,
    expert_modules,
    expert_width,
    read_checkpoint_config,
)
from services.common.model_shape import text_config
from services.common.progress import Progress
from services.common.staging import remove_abandoned, staging_name
from services.common.tensor_codec import dtype_name
from services.core.speculative.mtp_weights import MTP_FILE, extract_mtp_weights, mtp_layer_count
from services.tools.safetensors_header import check_safetensors
from services.tools.split_disk import GB, check_free_space, link_or_copy
from services.tools.split_vision import write_vision_weights

log = get_logger(__name__)

# Tokenizer and template files travel with the core; weights never do.
_CORE_FILE_SUFFIXES = (".json", ".txt", ".jinja", ".model", ".tiktoken", ".jsonl")
_SKIP_FILES = {"config.json", "model.safetensors.index.json"}


def _layer_index(path: str, fallback: int) -> int:
    parts = path.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return fallback


def _as_bytes_matrix(array: mx.array) -> np.ndarray:
    """[E, ...] array -> [E, nbytes_per_expert] uint8 view of its raw bytes."""
    host = np.ascontiguousarray(tensor_codec.numpy_view(array))
    return host.reshape(host.shape[0], -1).view(np.uint8)


def _write_layer(path: Path, params: dict[str, mx.array], num_experts: int, digest) -> tuple[int, list]:
    specs = []
    for name, array in params.items():  # one row per expert: _check_per_expert made sure
        per_expert = array.nbytes // num_experts
        specs.append((name, dtype_name(array.dtype), list(array.shape[1:]), per_expert))
    tensors, record_size = record_layout(specs)
    out = np.memmap(path, dtype=np.uint8, mode="w+", shape=(num_experts, record_size))
    for spec in tensors:
        array = params[spec.name]
        out[:, spec.offset : spec.offset + spec.nbytes] = _as_bytes_matrix(array)
    out.flush()
    digest.update(memoryview(out).cast("B"))
    del out
    return record_size, tensors


def split_checkpoint(model_path: Path, out_dir: Path, progress: bool = True) -> Manifest:
    """Split `model_path` into `out_dir`; return the manifest. Raises UnsupportedModelError."""
    model_path, out_dir = Path(model_path).resolve(), Path(out_dir).resolve()
    read_checkpoint_config(model_path)
    for weights in sorted(model_path.glob("*.safetensors")):  # a download cut short fails here, named
        check_safetensors(weights)
    _check_replaceable(out_dir)
    needed = check_free_space(model_path, out_dir)
    log.info("split_start", model=str(model_path), out=str(out_dir), needs_gb=round(needed / GB, 2))

    model, config = load_model(model_path, lazy=True, get_model_classes=model_classes)
    experts = list(expert_modules(model))
    if not experts:
        raise UnsupportedModelError(
            f"{model_path.name} ({config['model_type']}) is a dense model: it has no routed experts to split"
        )

    _check_per_expert(config, experts)
    check_batchable(model, config["model_type"])

    # a split into the same OUT that was killed outright left its staging folder: remove it
    remove_abandoned(out_dir.parent, f".{out_dir.name}.partial-")
    staging = out_dir.with_name(staging_name(f".{out_dir.name}.partial-"))
    try:
        manifest = _write_split(model_path, model, config, experts, staging, progress)
    except BaseException:  # a refusal, a crash, Ctrl-C: leave nothing half-written beside OUT
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if out_dir.exists():
        shutil.rmtree(out_dir)
    staging.rename(out_dir)
    log.info("split_done", out=str(out_dir), layers=len(manifest.layers), experts=manifest.num_experts)
    return manifest


def _check_per_expert(config: dict, experts: list) -> None:
    """Every parameter of an expert module must hold one row per expert: that is what a worker
    owning some experts of a layer loads. A tensor the layer's experts share cannot be split."""
    for path, module in experts:
        params = dict(tree_flatten(module.parameters()))
        leading = Counter(array.shape[0] if array.ndim else None for array in params.values())
        num_experts = leading.most_common(1)[0][0]
        for name, array in params.items():
            if not array.ndim or array.shape[0] != num_experts:
                raise UnsupportedModelError(
                    f"{config['model_type']} cannot be split: its expert module {path} holds {name}, "
                    f"{list(array.shape)}, one tensor shared by the layer's {num_experts} experts "
                    "rather than one per expert"
                )


SPLIT_ENTRIES = {"manifest.json", "core", "experts"}  # what a split folder holds


def _check_replaceable(out_dir: Path) -> None:
    """OUT is replaced as a whole, so it must be absent, empty, or an earlier split holding nothing
    else: a folder of the user's (a web app's manifest.json, notes put beside the split) is not."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise ManifestError(f"{out_dir} exists and is not a folder; refusing to overwrite it")
    entries = {entry.name for entry in out_dir.iterdir() if not entry.name.startswith(".")}  # .DS_Store
    if not entries:
        return  # empty (dotfiles aside)
    try:
        manifest = json.loads((out_dir / "manifest.json").read_text())
        is_split = isinstance(manifest, dict) and manifest.get("format", "").startswith("moe-mesh-split/")
    except (OSError, ValueError, AttributeError):
        is_split = False
    if not is_split:
        raise ManifestError(
            f"{out_dir} exists, is not empty and is not a moe-mesh split; refusing to overwrite it"
        )
    if entries - SPLIT_ENTRIES:
        others = ", ".join(sorted(entries - SPLIT_ENTRIES)[:5])
        raise ManifestError(
            f"{out_dir} is a moe-mesh split but also holds {others}; move them away, or split into another folder"
        )


def _write_split(
    model_path: Path, model, config: dict, experts: list, staging: Path, progress: bool
) -> Manifest:
    """Experts, core weights, config and manifest into `staging`; return the manifest."""
    (staging / "experts").mkdir(parents=True)
    (staging / "core").mkdir()
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    bar = Progress("split", len(experts) + 1, "layers", enabled=progress)
    layers, expert_paths = [], set()
    for order, (path, module) in enumerate(experts):
        params = dict(tree_flatten(module.parameters()))
        num_experts = next(iter(params.values())).shape[0]
        index = _layer_index(path, order)
        file = f"experts/layer_{index:03d}.bin"
        record_size, tensors = _write_layer(staging / file, params, num_experts, digest)
        layers.append(MoeLayer(index, path, num_experts, file, record_size, tensors))
        expert_paths.update(f"{path}.{name}" for name in params)
        bar.advance(1, nbytes=num_experts * record_size)
        log.debug("split_layer", layer=index, module=path, experts=num_experts, record_size=record_size)

    core_weights = {k: v for k, v in tree_flatten(model.parameters()) if k not in expert_paths}
    mx.save_safetensors(str(staging / "core" / "core.safetensors"), core_weights, metadata={"format": "mlx"})
    mtp_weights = extract_mtp_weights(model_path, config, model)  # mlx-lm drops them; core drafts with them
    if mtp_weights:
        mx.save_safetensors(str(staging / "core" / MTP_FILE), mtp_weights, metadata={"format": "mlx"})
        log.info("split_mtp_layers", tensors=len(mtp_weights))
    elif mtp_layer_count(config):
        # conversions such as mlx-lm's drop them: --speculative mtp will not serve this split
        log.warning("split_mtp_layers_absent", declared=mtp_layer_count(config))
    write_vision_weights(model_path, config, staging / "core")
    for name in sorted(core_weights):
        digest.update(name.encode())
    (staging / "core" / "config.json").write_text(json.dumps(config, indent=1, default=str))
    for item in model_path.iterdir():
        if item.is_file() and item.suffix in _CORE_FILE_SUFFIXES and item.name not in _SKIP_FILES:
            link_or_copy(item, staging / "core" / item.name)
    bar.advance(1)

    first = experts[0][1]
    hidden_dtype = _activation_dtype(core_weights)
    manifest = Manifest(
        fingerprint=digest.hexdigest()[:32],
        model_type=config["model_type"],
        config=config,
        hidden_size=_hidden_size(config, first),
        num_experts=int(layers[0].num_experts),
        layers=layers,
        source=str(model_path),
        dtype=hidden_dtype,
        extra={"expert_class": type(first).__name__},
    )
    manifest.save(staging / "manifest.json")
    return manifest


def _hidden_size(config: dict, expert_module) -> int:
    """The model's hidden size: the config's (top level or text_config), or where a config names
    it otherwise (phixtral's `model_dim`), the width its experts take."""
    for source in (config, text_config(config)):
        if "hidden_size" in source:
            return int(source["hidden_size"])
    width = expert_width(expert_module)
    if width is None:
        raise UnsupportedModelError("config has no hidden_size and the expert module shows no width")
    return width


def _activation_dtype(core_weights: dict[str, mx.array]) -> str:
    """The model's float dtype (what hidden states are in): the commonest float dtype in core."""
    counts: dict[str, int] = {}
    for array in core_weights.values():
        if mx.issubdtype(array.dtype, mx.floating):
            counts[dtype_name(array.dtype)] = counts.get(dtype_name(array.dtype), 0) + array.size
    return max(counts, key=counts.get) if counts else "float32"
