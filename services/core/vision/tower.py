"""Core's vision side: mlx-vlm's model for a vision-language checkpoint, sharing core's language model.

`split` writes the checkpoint's non-language weights (vision tower, projector: everything mlx-vlm
keeps outside `language_model`) to `core/vision.safetensors`. Core builds mlx-vlm's model for the
config, loads those weights into it, and then hands it core's own language-model modules, path for
path: the same arrays, the same `RemoteExperts` at every MoE layer. Nothing is loaded twice, and a
prompt with images runs through mlx-vlm's language model (3-D positions, DeepStack) with the very
modules the engine decodes with.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx import nn

from services.common.model_shape import text_config, vision_model_type
from services.common.module_paths import find_module, replace_modules
from services.common.vlm_language_models import VisionUnsupported, build_vision_model

VISION_FILE = "vision.safetensors"
LANGUAGE = "language_model"
# Families whose images core serves. Those with 3-D positions (Qwen's, GLM's) run mlx-vlm's language
# model on core's modules and caches; the others, with plain 1-D positions, run core's own language model
# from embeddings (vision/prefill.py). Others' vision-language checkpoints are split and served for
# text only.
IMAGE_FAMILIES = ("qwen3_vl_moe", "qwen3_5_moe", "kimi_vl", "minimax_m3_vl", "llama4", "glm4v_moe", "step3p7", "gemma4", "deepseek_vl_v2")  # fmt: skip
# Sequence mixers that keep recurrent state and take no positions (Gated DeltaNet): core's own
# module runs in their place, on the cache kind the engine made for it.
RECURRENT_MIXERS = ("linear_attn",)


def images_refused(config: dict) -> str | None:
    """Why a checkpoint's requests with images are refused (None: they are served)."""
    family = vision_model_type(config)
    if family is None:
        return "takes text only"
    if family not in IMAGE_FAMILIES:
        return f"({family}) is served for text only: moe-mesh serves images for {', '.join(IMAGE_FAMILIES)}"
    if text_config(config).get("hidden_size_per_layer_input"):  # Gemma's small dense models
        return f"({family}) with per-layer token inputs is served for text only"
    return None


def mlx_vlm_families() -> tuple[str, ...]:
    """mlx-vlm's model families that have routed experts and a vision tower, read from mlx-vlm's
    own sources (a family it adds is listed without anyone naming it here); () without mlx-vlm."""
    try:
        import mlx_vlm.models
    except ImportError:
        return ()
    root = Path(mlx_vlm.models.__file__).parent
    found = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and (p / "vision.py").exists()):
        sources = "".join(f.read_text(errors="ignore") for f in folder.glob("*.py"))
        if "SwitchGLU" in sources or "switch_layers" in sources:
            found.append(folder.name)
    return tuple(found)


def load_vision_weights(model: nn.Module, config: dict, path: Path) -> None:
    """`path`'s tensors into `model`'s non-language modules, quantized where the file is. Raises
    VisionUnsupported where the file and mlx-vlm's model disagree on a tensor."""
    weights = mx.load(str(path))
    quantization = config.get("quantization") or {}
    if quantization:

        def quantized_in_file(module_path: str, module: nn.Module) -> bool:
            return hasattr(module, "to_quantized") and f"{module_path}.scales" in weights

        nn.quantize(
            model,
            group_size=quantization.get("group_size", 64),
            bits=quantization.get("bits", 4),
            mode=quantization.get("mode", "affine"),
            class_predicate=quantized_in_file,
        )
    wanted = {k for k, _ in nn.utils.tree_flatten(model.parameters()) if not k.startswith(f"{LANGUAGE}.")}
    missing, unknown = sorted(wanted - set(weights)), sorted(set(weights) - wanted)
    if missing or unknown:
        raise VisionUnsupported(
            f"{path.name} does not match mlx-vlm's {config.get('model_type')} model: "
            f"missing {missing[:3]}, unknown {unknown[:3]}"
        )
    model.load_weights(list(weights.items()), strict=False)
    mx.eval({k: v for k, v in nn.utils.tree_flatten(model.parameters()) if k in weights})


def share_language_modules(vision_model: nn.Module, text_model: nn.Module, expert_paths: list[str]) -> None:
    """Put `text_model`'s modules into `vision_model` at the same paths: whole, the expert modules
    (`expert_paths`, whatever computes them: remote proxies or local experts) and the recurrent
    mixers (RECURRENT_MIXERS); every other leaf module of the language model. Raises
    VisionUnsupported where a parameter of mlx-vlm's language model is left without core's
    counterpart (the two models' layouts differ)."""
    mixers = [
        path
        for path, _ in text_model.named_modules()
        if path.rsplit(".", 1)[-1] in RECURRENT_MIXERS and _has_module(vision_model, path)
    ]
    expert_paths = [*expert_paths, *mixers]
    replace_modules(vision_model, {path: find_module(text_model, path) for path in expert_paths})
    under_experts = tuple(f"{path}." for path in expert_paths)
    leaves = {
        path: module
        for path, module in text_model.named_modules()
        if path.startswith(f"{LANGUAGE}.")
        and path not in expert_paths
        and not path.startswith(under_experts)
        and not _holds_module(module.children())
    }
    present = {path: module for path, module in leaves.items() if _has_module(vision_model, path)}
    replace_modules(vision_model, present)
    # arrays a module holds beside its children (Gated DeltaNet's A_log and dt_bias)
    for path, module in text_model.named_modules():
        if path in present or path.startswith(under_experts) or not _has_module(vision_model, path):
            continue
        target = find_module(vision_model, path)
        for key, value in module.items():
            if isinstance(value, mx.array) and isinstance(target.get(key), mx.array):
                target[key] = value
    shared = {id(v) for _, v in nn.utils.tree_flatten(text_model.parameters())}
    own = [
        k
        for k, v in nn.utils.tree_flatten(getattr(vision_model, LANGUAGE).parameters())
        if id(v) not in shared
    ]
    if own:
        raise VisionUnsupported(
            f"mlx-vlm's {LANGUAGE} and core's differ in layout ({len(own)} parameters unmatched, "
            f"first {own[0]}): images are not supported for this family"
        )


def share_embeddings(vision_model: nn.Module, text_model: nn.Module) -> None:
    """Put `text_model`'s token embeddings into `vision_model` at the same path: mlx-vlm's
    `get_input_embeddings` embeds with them, and the rest of its language model is never run."""
    paths = [
        path
        for path, _ in text_model.named_modules()
        if path.rsplit(".", 1)[-1] == "embed_tokens" and _has_module(vision_model, path)
    ]
    if not paths:
        raise VisionUnsupported("mlx-vlm's language model keeps its token embeddings elsewhere than core's")
    replace_modules(vision_model, {path: find_module(text_model, path) for path in paths})


def _holds_module(value) -> bool:
    if isinstance(value, nn.Module):
        return True
    if isinstance(value, list | tuple):
        return any(_holds_module(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_module(v) for v in value.values())
    return False


def _has_module(root: nn.Module, path: str) -> bool:
    try:
        return isinstance(find_module(root, path), nn.Module)
    except (AttributeError, IndexError, KeyError, ValueError):
        return False


def image_token_id(config: dict) -> int:
    """The token that stands for one image position in the prompt."""
    for key in ("image_token_id", "image_token_index", "media_placeholder_token_id"):
        if isinstance(config.get(key), int):
            return config[key]
    value = text_config(config).get("image_token_id")
    if isinstance(value, int):
        return value
    raise VisionUnsupported(f"{config.get('model_type')}: the config names no image token")


def plain_positions(language_model: nn.Module, config: dict) -> bool:
    """Whether the family places image tokens at plain 1-D positions, as text: no
    `get_rope_index`, or one that gives a prompt with an image one position per token (Qwen's
    give three, over time, height and width). A probe that fails counts as not plain."""
    if not hasattr(language_model, "get_rope_index"):
        return True
    # one merged image token between the vision markers, where the family has them
    markers = [config.get(key) for key in ("vision_start_token_id", "vision_end_token_id")]
    start, end = (m if isinstance(m, int) else 0 for m in markers)
    try:
        positions, _ = language_model.get_rope_index(
            mx.array([[0, start, image_token_id(config), end, 1]]), image_grid_thw=mx.array([[1, 2, 2]])
        )
    except Exception:  # noqa: BLE001 - another family's signature: take the shared-modules path
        return False
    return positions.ndim == 2


def processed_share(cache_bytes: int) -> int:
    """Of the image cache's budget, the bytes for processed pixels (the rest keeps the vision
    tower's outputs): an eighth, a few dozen images' at the processors' usual sizes per GB."""
    return cache_bytes // 8


def image_preparer(split_dir: Path, manifest, cache_bytes: int):
    """The request side of images for a split with a vision tower (its processor), else None.
    `cache_bytes`: the image cache's whole budget."""
    if not (Path(split_dir) / "core" / VISION_FILE).exists():
        return None
    from services.core.vision.prompt_images import ImagePreparer

    return ImagePreparer(
        Path(split_dir) / "core",
        manifest.config,
        image_token_id(manifest.config),
        processed_share(cache_bytes),
    )


def load_vision(split_dir: Path, manifest, text_model: nn.Module, cache_bytes: int):
    """The vision prefill of a split with a vision tower: mlx-vlm's model with the tower's weights
    and `text_model`'s language modules (its experts included). `cache_bytes`: the image cache's
    whole budget."""
    from services.core.vision.image_blocks import images_attend_both_ways
    from services.core.vision.prefill import VisionPrefill
    from services.core.vision.tower_mends import mend_tower

    config = manifest.config
    model = build_vision_model(config)
    mend_tower(model)
    load_vision_weights(model, config, Path(split_dir) / "core" / VISION_FILE)
    runs_own_language = plain_positions(getattr(model, LANGUAGE), config)
    if runs_own_language:
        share_embeddings(model, text_model)
    else:
        share_language_modules(model, text_model, [layer.module for layer in manifest.layers])
    model.eval()
    return VisionPrefill(
        model,
        cache_bytes - processed_share(cache_bytes),
        text_model=text_model if runs_own_language else None,
        both_ways=images_attend_both_ways(config),
    )
