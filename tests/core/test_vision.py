"""Images through core: tiny random vision-language checkpoints of every family core serves images
for, split, served with their experts in core's process, against mlx-vlm's own `generate` on the
original checkpoint; the image cache, the prefix cache, batching and refusals."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from PIL import Image

from services.core.cluster_status import fill_core_stats
from services.core.request_prep import RequestError
from services.core.speculative.config import SpeculativeConfig
from services.core.vision.prefill import image_spans, prefix_key
from services.core.vision.prompt_images import PromptImage, PromptImages
from services.core.vision.tower import IMAGE_FAMILIES, images_refused, mlx_vlm_families
from services.proto.moemesh.v1 import core_pb2
from services.tools.split import split_checkpoint
from services.tools.tiny_vlm import build_tiny_vlm
from tests.core.vision_serving import (
    LOSSY_CACHE_TIE,
    NEAR_TIE,
    TOKENS,
    WHOLE_PROMPT_ORACLE,
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


@pytest.fixture(scope="module")
def checkpoint(built):
    return built("qwen3_vl_moe")


@pytest.fixture(scope="module")
def served(checkpoint):
    server = Served(checkpoint / "split")
    yield server
    server.stop()


@pytest.mark.parametrize("kind", ["fp16", "turboquant"])
@pytest.mark.parametrize("family", IMAGE_FAMILIES)
def test_greedy_tokens_equal_mlx_vlm(built, family, kind):
    root = built(family)
    server = Served(root / "split", kv_cache=kind)
    # the order mlx-vlm's chat template puts them in: Kimi's and Llama's text first, Qwen's image first
    parts = ("Describe the image.", png(picture()))
    try:
        ((ids, _),) = server.generate(
            chat(user(*(parts if family in ("kimi_vl", "llama4") else parts[::-1])))
        )
    finally:
        server.stop()
    if family not in WHOLE_PROMPT_ORACLE:
        assert ids == mlx_vlm_greedy(root / "ckpt", "Describe the image.", [picture()])
        return
    # its oracle's answer leads by under 0.02 at places: the prefill's windows (paced by time) and a
    # lossy cache may part from it there
    tie = NEAR_TIE if kind == "fp16" else LOSSY_CACHE_TIE
    assert equal_up_to_a_near_tie(
        ids, *whole_prompt_greedy(root / "ckpt", "Describe the image.", [picture()]), tie
    )


def test_two_images_in_one_message_equal_mlx_vlm(served, checkpoint):
    first, second = picture(seed=1), picture(96, 64, seed=2)
    ((ids, _),) = served.generate(chat(user(png(first), png(second), "Compare them.")))
    assert ids == mlx_vlm_greedy(checkpoint / "ckpt", "Compare them.", [first, second])


def test_repeated_image_reuses_the_prefix_and_answers_the_same(served):
    request = chat(user(png(picture(seed=3)), "What is in it?"))
    (first,) = served.generate(request)
    encoded = served.features.misses
    (again,) = served.generate(request)
    assert again[0] == first[0]
    # everything but the last prompt token came from the prefix cache: the encoder did not run
    assert again[1] > 4 and served.features.misses == encoded


def test_image_after_a_new_prefix_reuses_its_vision_features(served, checkpoint):
    image = png(picture(seed=4))
    served.generate(chat(user(image, "Name one colour.")))
    hits = served.features.hits
    system = core_pb2.ChatMessage(role="system", content="You answer briefly.")
    ((ids, _),) = served.generate(chat(system, user(image, "Name one colour.")))
    assert served.features.hits == hits + 1
    stats = core_pb2.CoreStats()
    fill_core_stats(stats, served.engine)
    assert stats.image_cache.hits == served.features.hits and stats.image_cache.bytes > 0
    fresh = Served(checkpoint / "split", image_cache_bytes=0, prefix_cache_bytes=0)
    try:
        ((want, _),) = fresh.generate(chat(system, user(image, "Name one colour.")))
    finally:
        fresh.stop()
    assert ids == want


def test_a_changed_pixel_is_another_image(served):
    image = picture(seed=5)
    served.generate(chat(user(png(image), "And this?")))
    misses = served.features.misses
    changed = np.asarray(image).copy()
    changed[10, 10] ^= 0xFF
    ((_, cached),) = served.generate(chat(user(png(Image.fromarray(changed)), "And this?")))
    assert served.features.misses == misses + 1
    assert cached <= 4  # the image starts at position 4: nothing from it was reused


def test_text_and_image_requests_share_a_batch(served):
    text = chat(core_pb2.ChatMessage(role="user", content="Say something."))
    image = chat(user(png(picture(seed=6)), "Say something."))
    (alone_text,) = served.generate(text)
    (alone_image,) = served.generate(image)
    together = served.generate(text, image, text)
    assert [ids for ids, _ in together] == [alone_text[0], alone_image[0], alone_text[0]]


def test_count_tokens_includes_image_positions(served):
    counted = served.preparer.prompt_tokens(
        core_pb2.CountTokensRequest(chat=core_pb2.ChatInput(messages=[user(png(picture(64, 64)), "Hi")]))
    )
    assert counted.count(151655) == 4  # 64 x 64 pixels: 4 x 4 patches, merged 2 x 2


@pytest.mark.parametrize(
    ("data", "media_type", "says"),
    [
        (b"not an image at all", "image/png", "not a PNG, JPEG, WebP or GIF"),
        (b"", "image/png", "empty"),
        (png(picture())[:60], "image/png", "could not be decoded"),
        (png(picture()), "image/bmp", "not supported"),
    ],
)
def test_unusable_images_are_invalid_arguments(served, data, media_type, says):
    message = user("Look:", b"x")
    message.parts[1].image.data, message.parts[1].image.media_type = data, media_type
    with pytest.raises(RequestError) as raised:
        served.preparer.prepare(chat(message), None)
    assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "chat.messages[0].parts[1].image" in str(raised.value) and says in str(raised.value)


@pytest.mark.parametrize("size", [(1, 1), (27, 60), (2000, 20)])
def test_an_image_kimi_vl_leaves_no_patch_of_is_an_invalid_argument(built, size):
    """Kimi-VL's processor crops to whole 28-pixel cells: a thinner image would silently vanish
    from the prompt. It is refused, naming the field."""
    kimi = built("kimi_vl")
    server = Served(kimi / "split")
    try:
        with pytest.raises(RequestError) as raised:
            server.preparer.prepare(chat(user("Look:", png(picture(*size)))), None)
        assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "chat.messages[0].parts[1].image" in str(raised.value) and "too small" in str(raised.value)
        ((ids, _),) = server.generate(chat(user("Look:", png(picture(28, 28)))))
        assert len(ids) == TOKENS
    finally:
        server.stop()


def test_a_text_only_model_refuses_images(served):
    images, served.preparer.images = served.preparer.images, None
    try:
        with pytest.raises(RequestError) as raised:
            served.preparer.prepare(chat(user(png(picture()), "Hi")), None)
    finally:
        served.preparer.images = images
    assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "chat.messages[0].parts[0].image" in str(raised.value) and "takes text only" in str(raised.value)


def test_prefix_key_names_image_positions_by_their_pixels():
    images = PromptImages(
        (
            PromptImage("a" * 64, np.zeros(1), (1, 2, 2), 2, (9, 9)),
            PromptImage("b" * 64, np.zeros(1), (1, 2, 2), 2, (9, 9)),
        ),
        token_id=9,
    )
    kind, key = prefix_key("fp16", [1, 9, 9, 2, 9, 9, 3, 4], images, -2)
    assert kind == "fp16@images-2"
    assert key[0] == 1 and key[3] == 2 and key[6:] == [3, 4]
    assert key[1] == key[2] < 0 and key[4] == key[5] < 0 and key[1] != key[4]
    assert prefix_key("fp16", [1, 9, 9, 2], images, -2)[1] == key[:4]


def test_a_tiled_images_positions_skip_its_markers():
    """Llama 4's tiles: an image's positions split by marker tokens (7) are its own, the markers
    stay text, and the next image is found past the last of them."""
    tiled = PromptImage("a" * 64, np.zeros(1), None, 4, (9, 9, 7, 9, 9), offsets=(0, 1, 3, 4))
    plain = PromptImage("b" * 64, np.zeros(1), None, 2, (9, 9))
    images = PromptImages((tiled, plain), token_id=9)
    prompt = [1, 9, 9, 7, 9, 9, 2, 9, 9, 3]
    assert [(first, image.hash[0]) for first, image in image_spans(prompt, images)] == [(1, "a"), (7, "b")]
    _, key = prefix_key("fp16", prompt, images, 0)
    assert key[3] == 7 and key[6] == 2 and key[1] == key[2] == key[4] == key[5] < 0
    assert key[7] == key[8] < 0 and key[7] != key[1]
    assert prefix_key("fp16", prompt[:4], images, 0)[1] == key[:4]  # a prompt ending inside it


def test_vision_families_come_from_mlx_vlm_and_the_unserved_are_named():
    families = mlx_vlm_families()
    assert {"qwen3_vl_moe", "qwen3_5_moe", "kimi_vl"} <= set(families)
    for family in families:
        refused = images_refused({"model_type": family, "vision_config": {"depth": 1}})
        assert (refused is None) == (family in IMAGE_FAMILIES)
        assert refused is None or family in refused
    per_layer = {
        "model_type": "gemma4",
        "vision_config": {"depth": 1},
        "text_config": {"hidden_size_per_layer_input": 256},
    }
    assert "per-layer token inputs" in images_refused(per_layer)  # Gemma's inputs at image positions


@pytest.mark.parametrize("kind", ["fp16", "turboquant"])
def test_qwen3_5_moe_repeats_an_image_turn_from_its_kept_prefill(built, kind):
    """Recurrent state cannot be trimmed back to a prompt: the prefilled cache itself is kept, past
    the image and at the prompt's end. The same turn again reuses every position but the last, a
    new question about the image reuses the image's, and either batches with text."""
    hybrid = built("qwen3_5_moe")
    server = Served(hybrid / "split", kv_cache=kind, image_cache_bytes=0)
    image = png(picture(seed=3))
    request, other = chat(user(image, "What is in it?")), chat(user(image, "Which colour leads?"))
    prepared = server.preparer.prepare(request, None)
    first_image, shown = image_spans(prepared.prompt, prepared.images)[-1]
    past_image = first_image + shown.tokens
    try:
        ((first, _),) = server.generate(request)
        text = chat(core_pb2.ChatMessage(role="user", content="Say something."))
        (again, text_in_batch, new_question) = server.generate(request, text, other)
        (text_alone,) = server.generate(text)
    finally:
        server.stop()
    fresh = Served(hybrid / "split", kv_cache=kind, prefix_cache_bytes=0)
    try:
        ((want_other, _),) = fresh.generate(other)
    finally:
        fresh.stop()
    assert again == (first, len(prepared.prompt) - 1)
    assert new_question == (want_other, past_image)
    assert text_in_batch[0] == text_alone[0]


def test_a_family_core_cannot_serve_images_for_is_split_for_text_and_named(tmp_path, monkeypatch):
    monkeypatch.setattr("services.core.vision.tower.IMAGE_FAMILIES", ("qwen3_vl_moe",))
    build_tiny_vlm(tmp_path / "ckpt", family="qwen3_5_moe")
    split_checkpoint(tmp_path / "ckpt", tmp_path / "split", progress=False)
    assert not (tmp_path / "split" / "core" / "vision.safetensors").exists()
    server = Served(tmp_path / "split")
    try:
        ((ids, _),) = server.generate(chat(core_pb2.ChatMessage(role="user", content="Hello")))
        assert len(ids) == TOKENS
        with pytest.raises(RequestError) as raised:
            server.preparer.prepare(chat(user(png(picture()), "Hi")), None)
    finally:
        server.stop()
    assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "chat.messages[0].parts[0].image" in str(raised.value) and "qwen3_5_moe" in str(raised.value)


def test_ngram_speculation_keeps_an_image_turns_greedy_tokens(served, checkpoint):
    request = chat(user(png(picture(seed=7)), "Describe the image. Describe the image."))
    ((want, _),) = served.generate(request)
    speculating = Served(checkpoint / "split", speculative=SpeculativeConfig("ngram", 3, draft_cost=0.0))
    try:
        ((ids, _),) = speculating.generate(request)
    finally:
        speculating.stop()
    assert ids == want


def test_prompt_logprobs_are_refused_with_images(served):
    request = chat(user(png(picture()), "Hi"))
    request.prompt_logprobs = True
    with pytest.raises(RequestError) as raised:
        served.preparer.prepare(request, None)
    assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT and "prompt_logprobs" in str(raised.value)


def test_an_image_prompt_prefills_in_step_sized_chunks_beside_decoding(checkpoint):
    # 128 x 128 pixels: 64 image positions, prefilled 8 positions a step across the image's span
    image, question = picture(128, 128, seed=8), "What is in the picture?"
    text = chat(core_pb2.ChatMessage(role="user", content="Tell me a story."))
    small_steps = Served(checkpoint / "split", max_num_batched_tokens=8)
    try:
        (alone_text,) = small_steps.generate(text)
        together = small_steps.generate(text, chat(user(png(image), question)))
    finally:
        small_steps.stop()
    assert together[0][0] == alone_text[0]
    assert together[1][0] == mlx_vlm_greedy(checkpoint / "ckpt", question, [image])


def test_a_request_cancelled_while_its_image_prefills_leaves_nothing_behind(checkpoint):
    server = Served(checkpoint / "split", max_num_batched_tokens=2)
    engine = server.engine
    try:

        async def cancel_early():
            loop, out = asyncio.get_running_loop(), asyncio.Queue()
            request = server.preparer.prepare(chat(user(png(picture(256, 256, seed=9)), "Hi")), None)
            sequence = engine.submit(request, out, loop)
            for _ in range(200):  # until its prefill has started
                await asyncio.sleep(0.01)
                if engine.image_prefills.pending:
                    break
            engine.cancel(sequence)
            for _ in range(500):
                await asyncio.sleep(0.01)
                if not engine.image_prefills.pending and engine.running + engine.waiting == 0:
                    return True
            return False

        assert asyncio.run(cancel_early())
        ((ids, _),) = server.generate(chat(user(png(picture(seed=10)), "Still there?")))
        assert len(ids) == TOKENS
    finally:
        server.stop()


def test_a_text_only_chat_template_never_sees_image_parts(tiny_models):
    from services.common.manifest import Manifest
    from services.core.model_loader import load_core_tokenizer
    from services.core.request_prep import RequestPreparer

    split = tiny_models.split("qwen3_moe", None)  # Qwen3's text template: string contents only
    preparer = RequestPreparer(load_core_tokenizer(split, Manifest.load(split)), "text-model", 4096, 151936)
    for method in (lambda r: preparer.prepare(r, None), preparer.prompt_tokens):
        with pytest.raises(RequestError) as raised:
            method(
                chat(core_pb2.ChatMessage(role="system", content="Be brief."), user("Look:", png(picture())))
            )
        assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert str(raised.value) == "chat.messages[1].parts[1].image: model 'text-model' takes text only"
