"""The vision side of a vision-language checkpoint, for core: what mlx-vlm keeps outside the
language model (vision tower, projector), loaded and converted by mlx-vlm's own loader.

mlx-lm, which reads the checkpoint for the split, drops these weights; core needs them to encode
images (services/core/vision/tower.py). A checkpoint mlx-vlm cannot read is split for text only,
with a warning that says why.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from services.common.logging import get_logger
from services.common.model_shape import vision_model_type
from services.core.vision.tower import LANGUAGE, VISION_FILE, images_refused

log = get_logger(__name__)


def write_vision_weights(model_path: Path, config: dict, core_dir: Path) -> int:
    """Write `core_dir/vision.safetensors` for a checkpoint with a vision tower; returns the
    tensors written (0 for a text-only checkpoint, or where mlx-vlm cannot read it)."""
    family = vision_model_type(config)
    if family is None:
        return 0
    refused = images_refused(config)
    if refused is not None:
        log.warning("split_text_only", family=family, reason=f"this checkpoint {refused}")
        return 0
    try:
        from mlx_vlm.utils import load_model
    except ImportError:
        log.warning("split_text_only", family=family, reason="mlx-vlm is not installed: no images")
        return 0
    try:
        model = load_model(Path(model_path), lazy=True)
    except Exception as error:  # noqa: BLE001 - whatever mlx-vlm refuses, the text split still stands
        log.warning("split_text_only", family=family, reason=f"mlx-vlm cannot read it: {error}")
        return 0
    weights = {k: v for k, v in tree_flatten(model.parameters()) if not k.startswith(f"{LANGUAGE}.")}
    if not weights:
        return 0
    mx.save_safetensors(str(Path(core_dir) / VISION_FILE), weights, metadata={"format": "mlx"})
    log.info("split_vision_tower", family=family, tensors=len(weights))
    return len(weights)
