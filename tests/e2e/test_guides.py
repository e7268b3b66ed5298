"""The guides in docs/ work as written: every command, in order, on a tiny checkpoint published in a
Hugging Face cache under the guide's own repo id, with loopback in place of the second Mac."""

from __future__ import annotations

import json
import os
import plistlib
import re
from pathlib import Path

import pytest

from services.tools.synthetic_model import TINY_CONFIGS, build_random_checkpoint
from tests.e2e.guide_runner import GuideRun
from tests.helpers import free_port, place_in_hf_cache, short_dir

DOCS = Path(__file__).resolve().parents[2] / "docs"
REPO_ID = "mlx-community/Qwen3-30B-A3B-4bit"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def qwen3_30b_a3b_stand_in(tmp_path_factory) -> Path:
    """Qwen3-30B-A3B's routing (128 experts, 8 per token, 4-bit) at a tiny width."""
    config = {**TINY_CONFIGS["qwen3_moe"], "num_experts": 128, "num_experts_per_tok": 8}
    return build_random_checkpoint(tmp_path_factory.mktemp("qwen3-30b-a3b-tiny"), config, bits=4)


@pytest.fixture
def guide_run(qwen3_30b_a3b_stand_in, tmp_path):
    hf_home = tmp_path / "hf-home"
    place_in_hf_cache(hf_home, REPO_ID, qwen3_30b_a3b_stand_in)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "MOE_MESH_CACHE")}
    env |= {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "MOE_MESH_CACHE": str(tmp_path / "cache")}
    ports = {port: str(free_port()) for port in ("8000", "50051", "50061", "50062")}
    run = GuideRun(short_dir("mm-guide-"), env, {"mac-b.local": "127.0.0.1", "0.0.0.0": "127.0.0.1", **ports})
    try:
        yield run
    finally:
        run.stop()


def _chat_reply(outputs: list[str]) -> dict:
    """The last JSON body with choices a guide command printed (curl prints no newline after it)."""
    out = next(out for out in reversed(outputs) if '"choices"' in out)
    return json.loads(out[out.rindex('{"id"') :])


def test_two_macs_guide(guide_run):
    guide_run.run((DOCS / "guide-two-macs.md").read_text())
    reply = _chat_reply(guide_run.outputs)
    assert reply["model"] == REPO_ID and reply["usage"]["completion_tokens"] > 0
    agents = {
        host: sorted(p.name for p in (home / "Library/LaunchAgents").glob("*.plist"))
        for host, home in guide_run.homes.items()
    }
    assert agents == {
        "mac-a": ["com.moe-mesh.core.plist", "com.moe-mesh.gateway.plist", "com.moe-mesh.worker-mac-a.plist"],
        "mac-b": ["com.moe-mesh.worker-mac-b.plist"],
    }
    worker_b = plistlib.loads(
        (guide_run.homes["mac-b"] / "Library/LaunchAgents" / agents["mac-b"][0]).read_bytes()
    )
    assert worker_b["KeepAlive"] is True and worker_b["ProgramArguments"][-2:] == ["--name", "mac-b"]
    # Mac B's copy is its own: the split and the certificates arrived there
    assert (guide_run.homes["mac-b"] / "moe-mesh/qwen3-30b-a3b/manifest.json").exists()
    assert (guide_run.homes["mac-b"] / "moe-mesh/certs/ca.pem").exists()
    assert not list(guide_run.state.glob("*.pid")), "the guide's bootout left a service running"


def test_larger_than_ram_guide(guide_run):
    # the stand-in's experts take 2.4 MB: a fifth of that in RAM streams the rest, as 8 GB of 16 does
    guide_run.substitutions |= {
        "--memory-gb 8": "--memory-gb 0.0005",
        "--expert-memory-gb 8": "--expert-memory-gb 0.0005",
    }
    guide_run.run((DOCS / "guide-larger-than-ram.md").read_text())
    reply = _chat_reply(guide_run.outputs)
    assert reply["model"] == REPO_ID and reply["usage"]["completion_tokens"] > 0
    plan = next(out for out in guide_run.outputs if "expected SSD reads" in out)
    resident = re.search(r"resident [\d.]+ GB \((\d+)%\)", plan)
    assert resident and 0 < int(resident.group(1)) < 50, plan
    iobench = next(out for out in guide_run.outputs if "queue depth" in out)
    assert [line.split()[0] for line in iobench.splitlines()[2:]] == ["1", "8", "32"]
