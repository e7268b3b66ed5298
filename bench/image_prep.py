"""What core does to an image before its vision tower, per family: the checkpoint's image processor as
mlx-vlm ships it, as core runs it (decoded, hashed, mended: services/core/vision/processor_mends.py),
and an image sent again (kept by its pixel hash); and Llama 4's patch cut for one 336-pixel tile,
mlx-vlm's slice per pixel against core's one reshape (services/core/vision/tower_mends.py).

    python bench/image_prep.py [--families step3p7,llama4,...] [--calls 5]

The checkpoints are the tiny ones of services/tools/tiny_vlm.py: the families' own processors at
their processor configs' sizes. One 448x336 PNG. Prints one JSON object, p50 in ms.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.timing import timed
from services.core.vision.prompt_images import ImagePreparer
from services.core.vision.tower import IMAGE_FAMILIES, image_token_id
from services.core.vision.tower_mends import patches
from services.proto.moemesh.v1 import core_pb2
from services.tools.tiny_vlm import build_tiny_vlm


def ms(fn, calls: int) -> float:
    return round(timed(fn, calls, warmup=1)["p50_us"] / 1e3, 2)


def png(width: int = 448, height: int = 336) -> core_pb2.ImageInput:
    pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return core_pb2.ImageInput(data=out.getvalue(), media_type="image/png")


def family_figures(root: Path, family: str, image: core_pb2.ImageInput, calls: int) -> dict:
    from mlx_vlm.utils import load_processor, prepare_inputs

    folder = root / family
    if not (folder / "config.json").exists():
        build_tiny_vlm(folder, family=family)
    config = json.loads((folder / "config.json").read_text())
    uncached = ImagePreparer(folder, config, image_token_id(config), 0)
    kept = ImagePreparer(folder, config, image_token_id(config), 1 << 30)
    with contextlib.redirect_stdout(sys.stderr):  # DeepSeek-VL2's processor prints the tokens it adds
        shipped = load_processor(str(folder), add_detokenizer=False)
    picture = Image.open(io.BytesIO(image.data)).convert("RGB")
    kept._one("image", image, "")
    return {
        "positions": uncached._one("image", image, "").tokens,
        "mlx_vlm_processor_ms": ms(
            lambda: prepare_inputs(shipped, images=[picture], prompts=[uncached.placeholder]), calls
        ),
        "core_first_ms": ms(lambda: uncached._one("image", image, ""), calls),
        "core_again_ms": ms(lambda: kept._one("image", image, ""), calls),
    }


def llama4_patch_cut(calls: int) -> dict:
    from mlx_vlm.models.llama4.vision import Llama4UnfoldConvolution

    class Patching:
        patch_size, num_channels, hidden_size = 14, 3, 8

    module = Llama4UnfoldConvolution(Patching())
    tile = mx.random.normal((1, 3, 336, 336))
    mx.eval(tile)
    return {
        "mlx_vlm_unfold_ms": ms(lambda: mx.eval(module.unfold(tile)), calls),
        "reshape_ms": ms(lambda: mx.eval(patches(tile, (14, 14))), calls),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--families", default=",".join(IMAGE_FAMILIES), help="comma-separated")
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    root = (
        Path(os.environ.get("MOE_MESH_CACHE", Path.home() / ".cache" / "moe-mesh")) / "bench" / "image-prep"
    )
    image = png()
    families = {}
    for family in args.families.split(","):
        families[family] = family_figures(root, family, image, args.calls)
        print(f"[bench] {family}: {families[family]}", file=sys.stderr)
    report = {
        "bench": "image_prep",
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, mlx {mx.__version__} on {mx.default_device()}",
        "image": "448x336 PNG",
        "calls": args.calls,
        "families": families,
        "llama4_patch_cut_336px_tile": llama4_patch_cut(args.calls),
        "command": " ".join(["python bench/image_prep.py", *sys.argv[1:]]),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
