"""Images through `moe-mesh up --experts 3`: tiny random Qwen3-VL-MoE, Qwen3.5-MoE and Kimi-VL checkpoints,
asked about an image with the official `openai` and `anthropic` clients, answers what `mlx_vlm.generate` answers on
the same checkpoint, image and prompt; a repeated image is served from the caches."""

from __future__ import annotations

import base64
import io

import anthropic
import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from services.tools.tiny_vlm import build_tiny_vlm
from tests.core.vision_serving import TOKENS, mlx_vlm_greedy
from tests.e2e.test_up import launch_up, wait_serving
from tests.helpers import short_dir

pytest.importorskip("mlx_vlm")
pytestmark = pytest.mark.slow

QUESTION = "Describe the image."


def image_bytes(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


def mlx_vlm_answer(checkpoint, image: bytes) -> str:
    from mlx_vlm.utils import load_processor

    picture = Image.open(io.BytesIO(image)).convert("RGB")
    ids = mlx_vlm_greedy(checkpoint, QUESTION, [picture])
    return load_processor(str(checkpoint), add_detokenizer=False).tokenizer.decode(ids)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    checkpoint = build_tiny_vlm(root / "tiny-qwen3-vl-moe")
    workdir = short_dir("mm-img-")
    proc, url = launch_up(root / "cache", workdir, "--model", str(checkpoint), "--experts", "3")
    try:
        want = mlx_vlm_answer(checkpoint, image_bytes(0))  # while the services start
        wait_serving(proc)
        yield url, want
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def ask_openai(url: str, image: bytes, text_first: bool = False):
    """`text_first`: the question before the image, where mlx-vlm's chat template puts it (Kimi-VL)."""
    client = openai.OpenAI(base_url=url, api_key="unused")
    data_url = "data:image/png;base64," + base64.b64encode(image).decode()
    parts = [{"type": "image_url", "image_url": {"url": data_url}}, {"type": "text", "text": QUESTION}]
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": parts[::-1] if text_first else parts}],
        temperature=0,
        max_tokens=TOKENS,
    )


def test_openai_client_answers_as_mlx_vlm(served):
    url, want = served
    reply = ask_openai(url, image_bytes(0))
    assert reply.choices[0].message.content == want
    assert reply.usage.prompt_tokens == 18  # the image's 4 positions included


def test_repeated_image_is_served_from_the_caches_with_the_same_answer(served):
    url, want = served
    ask_openai(url, image_bytes(1))
    again = ask_openai(url, image_bytes(1))
    first = ask_openai(url, image_bytes(0))
    assert first.choices[0].message.content == want
    assert again.usage.prompt_tokens_details.cached_tokens >= 8  # past the image's positions
    metrics = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=30).text
    assert "moe_mesh_prefix_cache_hit_tokens" in metrics and "moe_mesh_image_cache_misses" in metrics


def test_anthropic_client_answers_as_mlx_vlm(served):
    url, want = served
    client = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key="unused")
    reply = client.messages.create(
        model=openai.OpenAI(base_url=url, api_key="unused").models.list().data[0].id,
        max_tokens=TOKENS,
        extra_body={"temperature": 0},  # this client's newest models take no temperature
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "image",
                        "source": {
                            "type": "base64",
                            "media_type": "image/png",
                            "data": base64.b64encode(image_bytes(0)).decode(),
                        },
                    },
                    {"type": "text", "text": QUESTION},
                ],
            }
        ],
    )
    assert "".join(block.text for block in reply.content if block.type == "text") == want


def test_a_corrupt_image_is_a_400_naming_the_field(served):
    url, _ = served
    client = openai.OpenAI(base_url=url, api_key="unused")
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}},
                        {"type": "text", "text": QUESTION},
                    ],
                }
            ],
            max_tokens=4,
        )
    assert "messages[0].content[0]" in str(raised.value)


@pytest.mark.parametrize(
    "family",
    ["qwen3_5_moe", "kimi_vl", "minimax_m3_vl", "llama4", "glm4v_moe", "step3p7", "gemma4", "deepseek_vl_v2"],
)
def test_another_family_through_up_answers_as_mlx_vlm(tmp_path, family):
    """A Qwen3.5-MoE checkpoint with vision weights (Gated DeltaNet and attention layers), a
    Kimi-VL one (MoonViT, DeepSeek-V3's MLA language model, plain positions) or a MiniMax-M3-VL
    one (a CLIP tower, block-sparse attention, markers its processor adds), a Llama 4 one
    (chunked attention, top-1 experts, tiles), a GLM-4.5V one (GLM-4.5's language model, which
    mlx-lm has no VL class for, 3-D positions), a Step-3.7 one (Step-3.5's, sliding windows) or a
    Gemma 4 one (image positions attending both ways), its experts on 3
    workers: the openai client's answer about an image is mlx_vlm.generate's, and asking again
    reuses the prompt's prefill past the image (Kimi-VL's ends at position 12 of 18)."""
    checkpoint = build_tiny_vlm(tmp_path / f"tiny-{family}", family=family)
    proc, url = launch_up(
        tmp_path / "cache", short_dir("mm-img-"), "--model", str(checkpoint), "--experts", "3"
    )
    text_first = family in ("kimi_vl", "llama4")
    try:
        want = mlx_vlm_answer(checkpoint, image_bytes(2))
        wait_serving(proc)
        first, again = (ask_openai(url, image_bytes(2), text_first) for _ in range(2))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert first.choices[0].message.content == again.choices[0].message.content == want
    cached = again.usage.prompt_tokens_details.cached_tokens
    if family == "qwen3_5_moe":  # recurrent state: the prefilled cache itself is kept, whole
        assert cached == again.usage.prompt_tokens - 1
    else:  # attention caches: the prefix cache's longest match, past the image's positions
        assert 12 <= cached < again.usage.prompt_tokens
