"""A split states the disk it needs and refuses, before writing anything, where the disk is short;
core's small files are hard links to the checkpoint's where both share a filesystem."""

from __future__ import annotations

import shutil
from collections import namedtuple

import pytest

from services.common.manifest import ManifestError
from services.ops.plan import format_plan, memory_plan
from services.tools import split_disk
from services.tools.split import split_checkpoint


def test_a_short_disk_is_refused_before_anything_is_written(tiny_models, tmp_path, monkeypatch):
    checkpoint = tiny_models.checkpoint("qwen3_moe", None)
    needed = split_disk.split_bytes(checkpoint)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(split_disk.shutil, "disk_usage", lambda path: usage(needed, needed, needed // 2))
    with pytest.raises(ManifestError, match=r"needs 0\.\d\d GB in .* which has 0\.\d\d GB free"):
        split_checkpoint(checkpoint, tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_core_files_are_linked_and_plan_states_the_disk(tiny_models, tmp_path):
    checkpoint = tiny_models.checkpoint("qwen3_moe", None)
    split_checkpoint(checkpoint, tmp_path / "out", progress=False)
    linked = tmp_path / "out" / "core" / "tokenizer.json"
    assert linked.stat().st_ino == (checkpoint / "tokenizer.json").stat().st_ino
    written = sum(f.stat().st_size for f in (tmp_path / "out").rglob("*") if f.is_file())
    assert split_disk.split_bytes(checkpoint) >= written  # the stated figure is not an undercount
    plan = memory_plan(checkpoint, memory_gb=1)
    assert plan["split_disk_bytes"] == split_disk.split_bytes(checkpoint)
    assert "splitting it first writes" in format_plan(plan)
    assert memory_plan(tmp_path / "out", memory_gb=1)["split_disk_bytes"] == 0
    shutil.rmtree(tmp_path / "out")
