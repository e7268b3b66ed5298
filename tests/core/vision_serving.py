"""Serving helpers for the vision tests: tiny vision-language checkpoints built and split once per
module, an engine over a split with its experts in core's process, and mlx-vlm's own greedy output."""

from __future__ import annotations

import asyncio
import io

import numpy as np
from PIL import Image

from services.core.engine_config import EngineConfig
from services.core.expert_link.local_spec import LocalExpertsSpec
from services.core.server import build_engine
from services.core.vision.processor_mends import mend_processor
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


def tiny_vlms(tmp_path_factory):
    """`get(family)`: the family's tiny checkpoint (`ckpt`) and its split (`split`), under one
    folder, each built once. Every family's is as mlx-vlm saves it (FAMILIES in tiny_vlm)."""
    roots = {}

    def get(family: str):
        if family not in roots:
            roots[family] = built_and_split(tmp_path_factory, family)
        return roots[family]

    return get


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


def mlx_vlm_greedy(path, text: str, images: list[Image.Image]) -> list[int]:
    from mlx_vlm import generate, load
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = load(str(path))
    mend_processor(processor)  # mlx-vlm's Llama 4 processor makes no global tile (processor_mends.py)
    prompt = apply_chat_template(processor, model.config, text, num_images=len(images))
    result = generate(model, processor, prompt, images, max_tokens=TOKENS, temperature=0.0, verbose=False)
    return list(result.token_ids)
