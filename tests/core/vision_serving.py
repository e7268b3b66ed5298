"""Serving helpers for the vision tests: tiny vision-language checkpoints built and split once per
module, an engine over a split with its experts in core's process, and mlx-vlm's own greedy output."""

from __future__ import annotations

import asyncio
import io
import shutil
from contextlib import contextmanager

import numpy as np
from PIL import Image

from services.core.engine_config import EngineConfig
from services.core.expert_link.local_spec import LocalExpertsSpec
from services.core.server import build_engine
from services.core.vision.processor_mends import mend_processor
from services.core.vision.tower_mends import padded_crops
from services.proto.moemesh.v1 import core_pb2
from services.tools.split import split_checkpoint
from services.tools.tiny_vlm import build_tiny_vlm

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


@contextmanager
def tiny_vlms(tmp_path_factory):
    """`get(family)`: the family's tiny checkpoint (`ckpt`) and its split (`split`), under one
    folder, each built once. Every family's is as mlx-vlm saves it (FAMILIES in tiny_vlm). The
    folders go when the context ends: a module's families take a few hundred MB of disk each."""
    roots = {}

    def get(family: str):
        if family not in roots:
            roots[family] = built_and_split(tmp_path_factory, family)
        return roots[family]

    try:
        yield get
    finally:
        for root in roots.values():
            shutil.rmtree(root, ignore_errors=True)


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


def mlx_vlm_greedy(path, text: str, images: list[Image.Image], start: str = "") -> list[int]:
    """mlx-vlm's greedy tokens for `text` after `images`, its prompt from `start` on."""
    from mlx_vlm import generate

    model, processor, prompt = _mlx_vlm_prompt(path, text, images, start)
    if model.config.model_type in WHOLE_PROMPT_ORACLE and images:
        return whole_prompt_greedy(path, text, images, start)[0]
    result = generate(model, processor, prompt, images, max_tokens=TOKENS, temperature=0.0, verbose=False)
    return list(result.token_ids)


def _mlx_vlm_prompt(path, text: str, images: list[Image.Image], start: str):
    from mlx_vlm import load
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = load(str(path))
    mend_processor(processor)  # mlx-vlm's Llama 4 processor makes no global tile (processor_mends.py)
    return (
        model,
        processor,
        start + apply_chat_template(processor, model.config, text, num_images=len(images)),
    )


# Families `mlx_vlm.generate` answers at random on this CPU: mlx-vlm's DeepSeek-VL2 finds its image
# positions with NumPy over an MLX mask, which may read it before it is computed (and place no image),
# and mlx-vlm's own SwitchGLU takes a fused path for 2 to 8 tokens whose numbers vary from run to run.
# The oracle runs mlx-vlm's model with the mask in NumPy and mlx-lm's SwitchGLU (the same math).
WHOLE_PROMPT_ORACLE = ("deepseek_vl_v2",)
NEAR_TIE = 1e-2  # a top-2 logit gap within which float rounding may pick either token
LOSSY_CACHE_TIE = 0.5  # one within which a TurboQuant cache may (as tests/kv/test_demo_answers.py)


def whole_prompt_greedy(
    path, text: str, images: list[Image.Image], start: str = ""
) -> tuple[list[int], list[float]]:
    """Greedy tokens from mlx-vlm's model and processor (its experts mlx-lm's SwitchGLU): the
    prompt's embeddings (images placed) once, then its language model over all of them again at each
    step (no cache); and each step's top-2 logit gap."""
    import mlx.core as mx
    from mlx_vlm.utils import prepare_inputs

    from services.common.module_paths import replace_modules
    from services.common.vlm_language_models import mlx_lm_experts

    model, processor, prompt = _mlx_vlm_prompt(path, text, images, start)
    for module_path, module in list(model.named_modules()):
        if type(module).__name__ == "SwitchGLU":
            experts = mlx_lm_experts(module)
            experts.update(module.parameters())
            replace_modules(model, {module_path: experts})
    inputs = prepare_inputs(processor, images=images, prompts=prompt)  # as mlx_vlm.generate does
    mx.eval([value for value in inputs.values() if isinstance(value, mx.array)])
    ids, positions = inputs["input_ids"], np.asarray(inputs["images_seq_mask"])
    text_only = model.language_model.model.embed_tokens(ids)
    # its merge reads an entry per tile and stops at a zero one: padded as its batch collation pads
    crops = padded_crops(inputs["images_spatial_crop"], inputs["pixel_values"].shape[1])
    for _ in range(5):  # its merge may still place no image (read positions it has not computed)
        embeds = model.get_input_embeddings(ids, inputs["pixel_values"], crops, positions).inputs_embeds
        mx.eval(embeds)
        if not mx.array_equal(embeds, text_only).item():
            break
    else:
        raise AssertionError("mlx-vlm placed no image in five tries")
    out, gaps = [], []
    for _ in range(TOKENS):
        logits = model.language_model(ids, inputs_embeds=embeds).logits[0, -1]
        top = mx.sort(logits)[-2:].tolist()
        out.append(int(mx.argmax(logits).item()))
        gaps.append(top[1] - top[0])
        token = mx.array([[out[-1]]])
        ids = mx.concatenate([ids, token], axis=1)
        embeds = mx.concatenate([embeds, model.language_model.model.embed_tokens(token)], axis=1)
    return out, gaps


def equal_up_to_a_near_tie(ids: list[int], want: list[int], gaps: list[float], tie: float = NEAR_TIE) -> bool:
    """`ids` are `want`, or equal to it up to a step where `want`'s top two logits were within `tie`
    (after which the two may part ways)."""
    for step, (got, wanted) in enumerate(zip(ids, want, strict=True)):
        if got != wanted:
            return gaps[step] <= tie
    return True
