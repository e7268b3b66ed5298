"""`moe-mesh plan` and `moe-mesh iobench` on a tiny split."""

from __future__ import annotations

import json

import pytest

from services.common.manifest import Manifest
from services.experts.iobench import run_iobench
from services.experts.streaming_store import expert_bytes
from services.ops.cli import build_parser
from services.ops.plan import memory_plan


def run_cli(*argv: str) -> None:
    """The subcommand as `moe-mesh` runs it, minus logging setup (global, and pytest's streams close)."""
    args = build_parser().parse_args(list(argv))
    args.func(args)


def test_plan_splits_experts_between_ram_and_disk(tiny_models, capsys):
    split = tiny_models.split("qwen3_moe", 4)
    manifest = Manifest.load(split)
    per_expert = expert_bytes(manifest.layers[0])
    shard = per_expert * 4 * len(manifest.layers)  # 2 workers x 4 of the 8 experts
    budget_gb = shard / 4 / 1e9
    plan = memory_plan(split, memory_gb=budget_gb, workers=2, context=1000, seqs=2)
    assert plan["expert_bytes"] == 2 * shard
    assert plan["core_bytes"] == (split / "core" / "core.safetensors").stat().st_size
    for worker in plan["workers"]:
        assert worker["shard_bytes"] == shard
        assert worker["resident_bytes"] == int(budget_gb * 1e9)
        assert worker["streamed_bytes"] == shard - worker["resident_bytes"]
    # top-2 of 8 per layer, half on each worker, 3/4 of each worker's experts on disk.
    record = manifest.layers[0].record_size
    assert plan["expected_ssd_bytes_per_token"] == pytest.approx(
        len(manifest.layers) * 2 * 0.75 * record, rel=1e-3
    )
    # 4 layers x 2 (K and V) x 2 KV heads x 16 dims x 2 bytes, for 2 sequences of 1000 tokens.
    assert plan["kv"]["bytes_per_token"] == 4 * 2 * 2 * 16 * 2
    assert plan["kv"]["budget_bytes"] == plan["kv"]["bytes_per_token"] * 2000
    # core: what it loads, the KV for that context, then its two cache budgets (GiB, as core reads them)
    bounded = memory_plan(
        split, memory_gb=budget_gb, context=1000, seqs=2, prefix_cache_gb=0.5, mlx_cache_gb=0.25
    )
    assert bounded["core_memory"]["bound_bytes"] == plan["core_bytes"] + plan["kv"]["budget_bytes"] + (
        3 << 28
    )
    # a worker: its resident experts and its MLX buffer cache
    for worker in bounded["workers"]:
        assert worker["bound_bytes"] == worker["resident_bytes"] + (1 << 28)

    run_cli("plan", "--model", str(split), "--memory-gb", str(budget_gb), "--workers", "2")
    text = capsys.readouterr().out
    assert "worker 1 (experts 4-7)" in text and "MB per token" in text and "at most" in text
    checkpoint_plan = memory_plan(tiny_models.checkpoint("qwen3_moe", 4), memory_gb=budget_gb, workers=2)
    assert checkpoint_plan["expert_bytes"] == plan["expert_bytes"]  # same numbers from shapes alone


def test_plan_refuses_what_is_not_a_model(tmp_path):
    with pytest.raises(ValueError, match="neither a split"):
        memory_plan(tmp_path, memory_gb=1)


def test_iobench_measures_both_modes_at_the_record_size(tiny_models, capsys):
    split = tiny_models.split("qwen3_moe", 4)
    result = run_iobench(split, queue_depths=[1, 4], seconds=0.05)
    assert result["record_size"] == Manifest.load(split).layers[0].record_size
    for mode in ("direct", "buffered"):
        assert set(result["gbps"][mode]) == {"1", "4"}
        assert all(r["reads"] > 0 and r["gbps"] > 0 for r in result["runs"][mode].values())
    run_cli("iobench", str(split), "--queue-depths", "2", "--seconds", "0.05", "--json")
    assert json.loads(capsys.readouterr().out)["best"]["direct"]["queue_depth"] == 2
