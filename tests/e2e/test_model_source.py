"""`--model` takes a Hugging Face repo id, as `mlx_lm.load` does: resolved from the local Hugging
Face cache with the network off, served under the repo id; a repo that is neither cached nor
reachable is one line naming the cache and the repo."""

from __future__ import annotations

import os
from pathlib import Path

import openai
import pytest

from tests.e2e.test_up import start_up
from tests.helpers import place_in_hf_cache, run_cli, short_dir

pytestmark = pytest.mark.slow  # starts processes or computes for seconds

REPO_ID = "tiny-org/tiny-moe"


@pytest.fixture(scope="module")
def hf_home(tiny_models, tmp_path_factory) -> Path:
    """A Hugging Face cache holding the tiny qwen3_moe checkpoint as `REPO_ID`, main -> one commit."""
    home = tmp_path_factory.mktemp("hf-home")
    place_in_hf_cache(home, REPO_ID, tiny_models.checkpoint("qwen3_moe", None))
    return home


def offline_env(hf_home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_CACHE"}  # HF_HOME decides the cache
    return {**env, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}


def test_up_serves_a_cached_repo_id_offline(hf_home, monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    proc, url = start_up(tmp_path / "cache", short_dir("mm-hf-"), "--model", REPO_ID, "--local-experts")
    try:
        client = openai.OpenAI(base_url=url, api_key="unused")
        assert [model.id for model in client.models.list().data] == [REPO_ID]
        reply = client.completions.create(model=REPO_ID, prompt="one two", max_tokens=3, temperature=0)
        assert reply.usage.completion_tokens == 3 and reply.model == REPO_ID
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_repo_neither_cached_nor_reachable_is_one_line(hf_home, tmp_path):
    out = run_cli("split", "nobody/not-a-model", str(tmp_path / "out"), timeout=120, env=offline_env(hf_home))
    assert out.returncode != 0
    line = out.stderr.strip().splitlines()[-1]
    assert "nobody/not-a-model" in line and str(hf_home / "hub") in line
    assert not (tmp_path / "out").exists()
