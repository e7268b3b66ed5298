"""Images through core, family by family: Kimi-VL, Llama 4, GLM-4.5V, Step-3.7, Gemma 4 and
DeepSeek-VL2, each with its own image layout (several images, tiles between markers, crops, images
attending both ways, tiles by the prompt's count of images), against mlx-vlm's `generate`; and their checkpoints as published load into core's language
model."""

from __future__ import annotations

import mlx.core as mx
import pytest

from services.core.vision.prefill import image_spans
from services.tools.split import split_checkpoint
from services.tools.tiny_vlm import build_tiny_vlm
from services.tools.tiny_vlm_families import DEEPSEEK_VL_V2_BOS
from tests.core.vision_serving import (
    Served,
    chat,
    equal_up_to_a_near_tie,
    mlx_vlm_greedy,
    picture,
    png,
    tiny_vlms,
    user,
    whole_prompt_greedy,
)

pytest.importorskip("mlx_vlm")  # installed by the README's test command (requirements-vision.txt)
pytestmark = pytest.mark.slow  # serves a model and computes for seconds


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """`built(family)`: the family's tiny checkpoint and split, built once per module."""
    with tiny_vlms(tmp_path_factory) as get:
        yield get


def test_kimi_vl_two_images_and_a_repeated_turn_equal_mlx_vlm(built):
    """Kimi-VL runs core's own language model from embeddings: several images in one message give
    mlx-vlm's tokens, and the same turn again comes from the prefix cache with the same answer."""
    kimi = built("kimi_vl")
    first, second = picture(seed=1), picture(96, 64, seed=2)
    request = chat(user("Compare them.", png(first), png(second)))
    server = Served(kimi / "split")
    try:
        ((ids, _),) = server.generate(request)
        encoded = server.features.misses
        ((again, cached),) = server.generate(request)
    finally:
        server.stop()
    assert ids == mlx_vlm_greedy(kimi / "ckpt", "Compare them.", [first, second])
    assert again == ids and cached > 10 and server.features.misses == encoded == 2


def test_llama4_tiled_images_and_a_repeated_turn_equal_mlx_vlm(built):
    """Llama 4's processor cuts a wide image into tiles, their positions split by tile markers, and
    adds the whole image after them: a tiled image beside a one-tile one gives mlx-vlm's tokens, and
    the same turn again comes from the prefix cache with the same answer."""
    llama4 = built("llama4")
    wide, square = picture(150, 40, seed=5), picture(56, 56, seed=6)
    request = chat(user("Compare them.", png(wide), png(square)))
    server = Served(llama4 / "split")
    try:
        ((ids, _),) = server.generate(request)
        encoded = server.features.misses
        ((again, cached),) = server.generate(request)
        prompt = server.preparer.prepare(request, None)
        tower = server.engine.prompt_start.vision.model
    finally:
        server.stop()
    # its patches are cut by one reshape (tower_mends.py), and the tokens are still mlx-vlm's
    (embedding,) = [m for _, m in tower.named_modules() if type(m).__name__ == "Llama4UnfoldConvolution"]
    assert "unfold" in vars(embedding)
    tiled = prompt.images.images[0]
    assert tiled.tokens == 16 and tiled.span > tiled.tokens  # 3 tiles and the whole, 4 positions each
    assert ids == mlx_vlm_greedy(llama4 / "ckpt", "Compare them.", [wide, square])
    assert again == ids and cached > tiled.span and server.features.misses == encoded == 2
    # prefilled 5 positions a step: windows end between a tile's positions and on its markers
    stepped = Served(llama4 / "split", max_num_batched_tokens=5, prefix_cache_bytes=0)
    try:
        ((ids_stepped, _),) = stepped.generate(request)
    finally:
        stepped.stop()
    assert ids_stepped == ids


def test_glm4v_two_images_and_a_repeated_turn_equal_mlx_vlm(built):
    """GLM-4.5V's 3-D positions over two images of different sizes give mlx-vlm's tokens, and the
    same turn again comes from the prefix cache with the same answer."""
    glm4v = built("glm4v_moe")
    first, second = picture(seed=1), picture(96, 64, seed=2)
    request = chat(user(png(first), png(second), "Compare them."))
    server = Served(glm4v / "split")
    try:
        ((ids, _),) = server.generate(request)
        ((again, cached),) = server.generate(request)
    finally:
        server.stop()
    assert ids == mlx_vlm_greedy(glm4v / "ckpt", "Compare them.", [first, second])
    assert again == ids and cached > 10


def test_step3p7_cropped_image_in_small_windows_and_a_repeated_turn_equal_mlx_vlm(built):
    """Step-3.7's processor cuts a large image into 504-pixel crops, each between patch markers,
    before the whole image's positions: prefilled 64 positions a step, the answer is mlx-vlm's, and
    the same turn again comes from the prefix cache with the same answer."""
    step3p7 = built("step3p7")
    large = picture(1100, 700, seed=3)
    request = chat(user(png(large), "Describe the image."))
    server = Served(step3p7 / "split", max_num_batched_tokens=64)
    try:
        ((ids, _),) = server.generate(request)
        ((again, cached),) = server.generate(request)
        prompt = server.preparer.prepare(request, None)
    finally:
        server.stop()
    image = prompt.images.images[0]
    assert image.tokens == 169 + 4 * 81 and image.span > image.tokens  # the whole and four crops
    assert ids == mlx_vlm_greedy(step3p7 / "ckpt", "Describe the image.", [large])
    assert again == ids and cached == len(prompt.prompt) - 1


def test_glm4v_language_weights_load_from_hugging_faces_layout_too(built):
    """Hugging Face's GLM-4.5V keeps the language model under `model.language_model`, `lm_head` at
    the top and one tensor per expert; core's glm4_moe reads them as it reads mlx-vlm's layout."""
    glm4v = built("glm4v_moe")
    from services.common.model_build import build_skeleton
    from services.tools.tiny_vlm_families import GLM4V_MOE_CONFIG

    model = build_skeleton(GLM4V_MOE_CONFIG)
    saved = mx.load(str(glm4v / "ckpt" / "model.safetensors"))
    published = {"model.visual.patch_embed.proj.weight": mx.zeros((1,))}
    for key, value in saved.items():
        if ".switch_mlp." in key:  # [experts, ...] -> one tensor per expert
            head, tail = key.removeprefix("language_model.").split(".switch_mlp.")
            for expert in range(value.shape[0]):
                published[f"{head}.experts.{expert}.{tail}".replace("model.", "model.language_model.", 1)] = (
                    value[expert]
                )
        elif key.startswith("language_model.model."):
            published["model.language_model." + key.removeprefix("language_model.model.")] = value
        elif key.startswith("language_model.lm_head."):
            published[key.removeprefix("language_model.")] = value
    want = model.sanitize({k: v for k, v in saved.items() if k.startswith("language_model.")})
    got = model.sanitize(published)
    assert sorted(got) == sorted(want)
    assert all(mx.array_equal(got[k], want[k]).item() for k in want)


def test_a_kimi_vl_checkpoint_as_published_loads_in_mlx_lm_with_mlx_vlms_logits(built):
    """Kimi-VL checkpoints keep MLA's up-projection as `kv_b_proj`, which mlx-lm's own `kimi_vl`
    cannot load; `checkpoint_layouts` converts it, and the language model then computes what
    mlx-vlm's does."""
    kimi = built("kimi_vl")
    from mlx_lm.utils import load_model
    from mlx_vlm import load

    from services.common.checkpoint_layouts import model_classes

    weights = mx.load(str(kimi / "ckpt" / "model.safetensors"))
    assert any(".kv_b_proj." in key for key in weights)
    with pytest.raises(ValueError, match="kv_b_proj"):
        load_model(kimi / "ckpt", lazy=True)
    text_model, _ = load_model(kimi / "ckpt", get_model_classes=model_classes)
    vision_model, _ = load(str(kimi / "ckpt"))
    ids = mx.array([list(range(1000, 1012))])
    want = vision_model.language_model(ids)
    want = getattr(want, "logits", want)
    assert mx.allclose(text_model(ids), want, atol=1e-4).item()


def test_gemma4_images_attend_both_ways_in_small_windows_as_mlx_vlm(built, monkeypatch):
    """Gemma 4's image positions attend to each other both ways: two images prefilled 5 positions a
    step (each image's window grows to hold it whole) give mlx-vlm's tokens, and the same turn again
    comes from the prefix cache with the same answer. With causal masks alone the answer differs,
    so the opened blocks are what makes it equal."""
    gemma4 = built("gemma4")
    images, text = [picture(seed=0), picture(80, 40, seed=5)], "Compare them."
    request = chat(user(*(png(i) for i in images), text))
    want = mlx_vlm_greedy(gemma4 / "ckpt", text, images)
    server = Served(gemma4 / "split", max_num_batched_tokens=5)
    try:
        ((first, _),) = server.generate(request)
        ((again, cached),) = server.generate(request)
    finally:
        server.stop()
    assert first == again == want
    assert cached == len(server.preparer.prepare(request, None).prompt) - 1
    monkeypatch.setattr("services.core.vision.image_blocks.images_attend_both_ways", lambda config: False)
    causal = Served(gemma4 / "split", prefix_cache_bytes=0)
    try:
        ((causal_only, _),) = causal.generate(request)
    finally:
        causal.stop()
    assert causal_only != want


def test_deepseek_vl_v2_cuts_images_by_the_prompts_count_as_mlx_vlm(built):
    """DeepSeek-VL2's language model only mlx-vlm builds; its processor cuts images into tiles only
    in a prompt of at most two. One image and three images, prefilled 5 positions a step, give
    mlx-vlm's tokens (up to a near tie); the same pixels in either prompt are other images to both caches; the same
    turn again comes from the prefix cache past its images with the same answer."""
    deepseek = built("deepseek_vl_v2")
    images, text = [picture(40 + 16 * i, 70 - 10 * i, seed=3 + i) for i in range(3)], "Compare them."
    one, three = chat(user(png(images[1]), text)), chat(user(*(png(i) for i in images), text))
    server = Served(deepseek / "split", max_num_batched_tokens=5)
    try:
        ((alone, _),) = server.generate(one)
        ((together, _),) = server.generate(three)
        encoded = server.features.misses
        ((again, cached),) = server.generate(three)
        cut, uncut = (server.preparer.prepare(r, None).images.images for r in (one, three))
    finally:
        server.stop()
    assert equal_up_to_a_near_tie(alone, *whole_prompt_greedy(deepseek / "ckpt", text, images[1:2]))
    assert together == again and equal_up_to_a_near_tie(
        together, *whole_prompt_greedy(deepseek / "ckpt", text, images)
    )
    assert encoded == 4 and server.features.misses == 4  # the middle image twice, cut and uncut
    assert cut[0].tokens > uncut[1].tokens and cut[0].hash != uncut[1].hash
    prompt = server.preparer.prepare(three, None)
    last, image = image_spans(prompt.prompt, prompt.images)[-1]
    assert last + image.span <= cached < len(prompt.prompt)  # every image came from the prefix cache


def test_deepseek_vl_v2_with_latent_attention_answers_as_mlx_vlm(tmp_path):
    """DeepSeek-VL2-Small's and -Base's attention (MLA, as mlx-vlm computes it) through core's
    mlx-vlm language model, text and an image, with mlx-vlm's tokens."""
    build_tiny_vlm(tmp_path / "ckpt", family="deepseek_vl_v2", sizes={"text": {"qk_nope_head_dim": 16}})
    split_checkpoint(tmp_path / "ckpt", tmp_path / "split", progress=False)
    image, text = picture(seed=7), "What is it?"
    server = Served(tmp_path / "split")
    try:
        ((with_image, _), (text_only, _)) = server.generate(chat(user(png(image), text)), chat(user(text)))
    finally:
        server.stop()
    assert equal_up_to_a_near_tie(with_image, *whole_prompt_greedy(tmp_path / "ckpt", text, [image]))
    # mlx-vlm tokenizes a prompt without images itself, leaving out the start of text DeepSeek-VL2's
    # processor puts first (core's template puts it first in every prompt, as DeepSeek's processor)
    assert text_only == mlx_vlm_greedy(tmp_path / "ckpt", text, [], start=DEEPSEEK_VL_V2_BOS)


def test_deepseek_vl_v2_language_weights_load_from_hugging_faces_layout_too(built):
    """DeepSeek's published DeepSeek-VL2 keeps the language model under `language` with one tensor
    per expert (and spells `view_seperator`); core's mlx-vlm language model reads them as it reads
    mlx-vlm's layout, and leaves the vision tower's to mlx-vlm."""
    deepseek = built("deepseek_vl_v2")
    from services.common.model_build import build_skeleton, expert_modules
    from services.tools.tiny_vlm_families import DEEPSEEK_VL_V2_CONFIG

    model = build_skeleton(DEEPSEEK_VL_V2_CONFIG)
    assert all(type(m).__module__ == "mlx_lm.models.switch_layers" for _, m in expert_modules(model))
    saved = mx.load(str(deepseek / "ckpt" / "model.safetensors"))
    published = {"view_seperator": saved["view_separator"], "projector.layers.0.weight": mx.zeros((1,))}
    for key, value in saved.items():
        own = key.replace("language_model.", "language.", 1)
        if ".switch_mlp." in own:  # [experts, ...] -> one tensor per expert
            head, tail = own.split(".switch_mlp.")
            for expert in range(value.shape[0]):
                published[f"{head}.experts.{expert}.{tail}"] = value[expert]
        elif own.startswith("language."):
            published[own] = value
    want = model.sanitize(dict(saved))
    got = model.sanitize(published)
    assert sorted(got) == sorted(want) and all(k.startswith("language_model.") for k in want)
    assert all(mx.array_equal(got[k], want[k]).item() for k in want)
