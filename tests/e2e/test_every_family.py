"""Every MoE family the installed mlx-lm provides serves under `moe-mesh up --experts 2`.

The families are listed from mlx-lm's own sources (`mlx_lm_moe_families`), so one mlx-lm adds is
tested without anyone naming it; each gets a tiny random 4-bit checkpoint of its own architecture
(`tiny_config`: dense first layers, interleaved dense/MoE layers, shared experts, hybrid attention
as the family has them). Each worker holds half of every layer's experts, so core sums partial
layers as it does across any number of workers. Core's greedy tokens over gRPC must equal
`mlx_lm.stream_generate`'s on the same checkpoint, and the HTTP API answers a completion.
"""

from __future__ import annotations

import grpc
import httpx
import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.sample_utils import make_sampler

from services.proto.moemesh.v1 import core_pb2, core_pb2_grpc
from services.tools.moe_families import mlx_lm_moe_families, tiny_config
from services.tools.synthetic_model import build_random_checkpoint
from tests.e2e.test_up import launch_up, wait_serving
from tests.helpers import run_cli, short_dir

PROMPT = list(range(1000, 1012))
# Families that cannot work, with what `split` says: refused before anything is written.
REFUSED = {
    "muse_spark": "post_expert_norm",  # a norm shared by the layer's experts, inside their module
    "deepseek_v41": "LayerCache",  # caches mlx-lm's BatchGenerator cannot merge
}
TOKENS = 8

pytestmark = pytest.mark.slow


def mlx_lm_greedy(checkpoint) -> list[int]:
    model, tokenizer = mlx_lm.load(str(checkpoint))
    sampler = make_sampler(temp=0.0)
    tokens = [
        r.token for r in mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=TOKENS, sampler=sampler)
    ]
    del model
    mx.clear_cache()
    return tokens


def core_greedy(core_address: str) -> list[int]:
    with grpc.insecure_channel(core_address) as channel:
        request = core_pb2.GenerateRequest(
            token_ids=core_pb2.TokenIds(ids=PROMPT),
            sampling=core_pb2.SamplingParams(temperature=0),
            stopping=core_pb2.StoppingCriteria(max_tokens=TOKENS),
        )
        return [
            t
            for chunk in core_pb2_grpc.CoreStub(channel).Generate(request, timeout=300)
            for t in chunk.token_ids
        ]


def test_the_families_come_from_mlx_lm():
    families = mlx_lm_moe_families()
    assert {"qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "qwen3_5_moe"} <= set(families)
    assert "llama" not in families and "qwen3" not in families  # dense architectures are not listed


def tiny_checkpoint(family: str, root):
    """4-bit, as users run them; a config that states its own quantization keeps it."""
    config = tiny_config(family)
    return build_random_checkpoint(root / family, config, bits=None if "quantization" in config else 4)


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_family_that_cannot_work_is_refused_at_split(family, tmp_path):
    out = run_cli("split", str(tiny_checkpoint(family, tmp_path)), str(tmp_path / "split"))
    assert out.returncode != 0
    line = out.stderr.strip().splitlines()[-1]
    assert family in line and REFUSED[family] in line, line
    assert not (tmp_path / "split").exists()


@pytest.mark.parametrize("family", [f for f in mlx_lm_moe_families() if f not in REFUSED])
def test_family_serves_under_up_like_mlx_lm(family, tmp_path):
    checkpoint = tiny_checkpoint(family, tmp_path)
    workdir = short_dir("mm-fam-")
    proc, url = launch_up(tmp_path / "cache", workdir, "--model", str(checkpoint), "--experts", "2")
    try:
        want = mlx_lm_greedy(checkpoint)  # while the services start
        wait_serving(proc)
        assert core_greedy(f"unix:{workdir / 'core.sock'}") == want
        reply = httpx.post(
            f"{url}/completions",
            json={"model": family, "prompt": PROMPT, "max_tokens": 2, "temperature": 0},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=60)
