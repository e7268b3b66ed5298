"""What the image processor made of an image is kept by the hash of its pixels: an image sent again
(in any file format) skips the processor, another image or another prompt layout does not, and the
budget bounds what is kept."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image

from services.core.vision.kept_by_image import KeptByImage
from services.core.vision.tower import image_token_id, processed_share
from services.proto.moemesh.v1 import core_pb2
from services.tools.tiny_vlm import build_tiny_vlm

pytest.importorskip("mlx_vlm")  # installed by the README's test command (requirements-vision.txt)
pytestmark = pytest.mark.slow  # builds tiny vision-language checkpoints


def picture(seed: int, width: int = 64, height: int = 48) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def encoded(image: Image.Image, fmt: str = "PNG") -> core_pb2.ImageInput:
    out = io.BytesIO()
    image.save(out, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    return core_pb2.ImageInput(data=out.getvalue(), media_type=f"image/{fmt.lower()}")


def counting_preparer(tmp_path, family: str, cache_bytes: int):
    from services.core.vision.prompt_images import ImagePreparer

    build_tiny_vlm(tmp_path / family, family=family)
    config = json.loads((tmp_path / family / "config.json").read_text())
    preparer = ImagePreparer(tmp_path / family, config, image_token_id(config), cache_bytes)
    calls = []
    process = preparer._prepare_inputs

    def counted(*args, **kwargs):
        calls.append(1)
        return process(*args, **kwargs)

    preparer._prepare_inputs = counted
    return preparer, calls


def prepared(preparer, *images: core_pb2.ImageInput):
    prompt = [1] + [preparer.placeholder_id] * len(images) + [2]
    parts = [(f"chat.messages[0].parts[{i}].image", image) for i, image in enumerate(images)]
    return preparer.prepare(parts, prompt)


def test_an_image_sent_again_skips_the_processor(tmp_path):
    preparer, calls = counting_preparer(tmp_path, "qwen3_vl_moe", 1 << 26)
    first_ids, first = prepared(preparer, encoded(picture(1)))
    again_ids, again = prepared(preparer, encoded(picture(1), "WEBP"))  # the same pixels, another file
    assert len(calls) == 1
    assert again_ids == first_ids and again.images == first.images
    changed = np.asarray(picture(1)).copy()
    changed[0, 0, 0] ^= 1
    _, other = prepared(preparer, encoded(Image.fromarray(changed)))
    assert len(calls) == 2 and other.images[0].hash != first.images[0].hash
    assert len(preparer.processed) == 2 and preparer.processed.hits == 1


def test_without_a_budget_every_image_is_processed(tmp_path):
    preparer, calls = counting_preparer(tmp_path, "qwen3_vl_moe", 0)
    for _ in range(2):
        prepared(preparer, encoded(picture(1)))
    assert len(calls) == 2 and len(preparer.processed) == 0


def test_pixels_processed_for_another_prompt_layout_are_kept_apart(tmp_path):
    """DeepSeek-VL2 cuts images into tiles only in prompts of at most two: the same pixels in a
    prompt of three are another image to the processor and to the cache."""
    preparer, calls = counting_preparer(tmp_path, "deepseek_vl_v2", 1 << 26)
    alone_ids, alone = prepared(preparer, encoded(picture(1, 96, 64)))
    _, three = prepared(preparer, *(encoded(picture(1, 96, 64)) for _ in range(3)))
    assert len(calls) == 2  # one for the image alone, one for the three equal images
    assert three.images[0].hash != alone.images[0].hash
    assert three.images[0].tokens != alone.images[0].tokens
    assert prepared(preparer, encoded(picture(1, 96, 64)))[0] == alone_ids and len(calls) == 2


def test_step3p7_builds_its_vocabulary_once(tmp_path, monkeypatch):
    """Step-3.7's processor reads its image token from the whole vocabulary at every image."""
    preparer, _ = counting_preparer(tmp_path, "step3p7", 0)
    tokenizer = preparer.processor.tokenizer
    built = []
    build = type(tokenizer).get_vocab
    monkeypatch.setattr(type(tokenizer), "get_vocab", lambda self: built.append(1) or build(self))
    ids, images = prepared(preparer, encoded(picture(1)), encoded(picture(2)))
    assert built == []
    token = tokenizer.convert_tokens_to_ids(preparer.processor.image_token)
    assert sum(1 for t in ids if t == token) == sum(image.tokens for image in images.images) > 0


def test_the_image_cache_budget_is_shared_with_processed_pixels():
    assert processed_share(1 << 30) == 1 << 27 and processed_share(0) == 0


def test_kept_by_image_evicts_the_least_recently_used_by_bytes():
    kept = KeptByImage(100)
    kept.put("a", "A", 40)
    kept.put("b", "B", 40)
    assert kept.get("a") == "A"  # now b is the least recently used
    kept.put("c", "C", 40)
    assert "b" not in kept and "a" in kept and "c" in kept and kept.nbytes == 80
    kept.put("c", "C2", 50)  # replacing counts its bytes once
    assert kept.nbytes == 90 and kept.get("c") == "C2"
    kept.put("big", "X", 101)  # larger than the budget: not kept, nothing evicted
    assert "big" not in kept and len(kept) == 2
    assert (kept.hits, kept.misses) == (2, 0) and kept.get("b") is None and kept.misses == 1
