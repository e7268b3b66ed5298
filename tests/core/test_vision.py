"""Images through core: tiny random Qwen3-VL-MoE, Qwen3.5-MoE and Kimi-VL checkpoints, split, served
with their experts in core's process, against mlx-vlm's own `generate` on the original checkpoint."""

from __future__ import annotations

import asyncio
import io

import grpc
import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from services.core.cluster_status import fill_core_stats
from services.core.engine_config import EngineConfig
from services.core.expert_link.local_spec import LocalExpertsSpec
from services.core.request_prep import RequestError
from services.core.server import build_engine
from services.core.speculative.config import SpeculativeConfig
from services.core.vision.prefill import image_spans, prefix_key
from services.core.vision.processor_mends import mend_processor
from services.core.vision.prompt_images import PromptImage, PromptImages
from services.core.vision.tower import IMAGE_FAMILIES, images_refused, mlx_vlm_families
from services.proto.moemesh.v1 import core_pb2
from services.tools.split import split_checkpoint
from services.tools.tiny_vlm import build_tiny_vlm

pytest.importorskip("mlx_vlm")  # installed by the README's test command (requirements-vision.txt)
pytestmark = pytest.mark.slow  # serves a model and computes for seconds

TOKENS = 12


def picture(width: int = 64, height: int = 48, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def built_and_split(tmp_path_factory, family: str):
    root = tmp_path_factory.mktemp(family)
    build_tiny_vlm(root / "ckpt", family=family)
    split_checkpoint(root / "ckpt", root / "split", progress=False)
    return root


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """`built(family)`: the family's tiny checkpoint (`ckpt`) and its split (`split`), under one
    folder, built once per module. Every family's is as mlx-vlm saves it (FAMILIES in tiny_vlm)."""
    roots = {}

    def get(family: str):
        if family not in roots:
            roots[family] = built_and_split(tmp_path_factory, family)
        return roots[family]

    return get


@pytest.fixture(scope="module")
def checkpoint(built):
    return built("qwen3_vl_moe")


class Served:
    """An engine on the split, its experts in core's process."""

    def __init__(self, split, **config):
        self.engine, self.preparer, _ = build_engine(
            split, [], EngineConfig(**config), local_experts=LocalExpertsSpec("all")
        )
        self.engine.start()
        self.engine.loaded.wait()
        assert self.engine.load_error is None

    async def _run(self, request: core_pb2.GenerateRequest) -> tuple[list[int], int]:
        loop, out = asyncio.get_running_loop(), asyncio.Queue()
        self.engine.submit(self.preparer.prepare(request, None), out, loop)
        ids, cached = [], 0
        while True:
            chunk = await out.get()
            assert isinstance(chunk, core_pb2.GenerateChunk), chunk
            ids += list(chunk.token_ids)
            cached = max(cached, chunk.usage.cached_prompt_tokens)
            if chunk.finish_reason:
                return ids, cached

    def generate(self, *requests: core_pb2.GenerateRequest) -> list[tuple[list[int], int]]:
        async def run_all():
            return await asyncio.gather(*(self._run(r) for r in requests))

        return asyncio.run(run_all())

    @property
    def features(self):
        return self.engine.prompt_start.vision.features

    def stop(self):
        self.engine.stop()


@pytest.fixture(scope="module")
def served(checkpoint):
    server = Served(checkpoint / "split")
    yield server
    server.stop()


def chat(*messages: core_pb2.ChatMessage) -> core_pb2.GenerateRequest:
    request = core_pb2.GenerateRequest(chat=core_pb2.ChatInput(messages=list(messages)))
    request.stopping.max_tokens = TOKENS
    request.sampling.temperature = 0.0
    return request


def user(*parts) -> core_pb2.ChatMessage:
    content = [
        core_pb2.ContentPart(text=part)
        if isinstance(part, str)
        else core_pb2.ContentPart(image=core_pb2.ImageInput(data=part, media_type="image/png"))
        for part in parts
    ]
    return core_pb2.ChatMessage(role="user", parts=content)


def mlx_vlm_greedy(path, text: str, images: list[Image.Image]) -> list[int]:
    from mlx_vlm import generate, load
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = load(str(path))
    mend_processor(processor)  # mlx-vlm's Llama 4 processor makes no global tile (processor_mends.py)
    prompt = apply_chat_template(processor, model.config, text, num_images=len(images))
    result = generate(model, processor, prompt, images, max_tokens=TOKENS, temperature=0.0, verbose=False)
    return list(result.token_ids)


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
    assert ids == mlx_vlm_greedy(root / "ckpt", "Describe the image.", [picture()])


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
    finally:
        server.stop()
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
