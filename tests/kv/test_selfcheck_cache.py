"""A kernel self-check runs once per device and kernel build: later processes read the pass
from $MOE_MESH_CACHE, a changed kernel source checks again, and a failure is never kept."""

from __future__ import annotations

from metal.selfcheck import passes_once_per_build


def counting(result: bool):
    calls = []

    def check() -> bool:
        calls.append(1)
        return result

    return check, calls


def test_a_pass_is_remembered_per_build(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_MESH_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "kernel.cu"
    source.write_text("__global__ void k() {}")
    check, calls = counting(True)
    assert passes_once_per_build("test", [source], check)
    assert passes_once_per_build("test", [source], check)
    assert len(calls) == 1  # the second process-equivalent read the pass
    source.write_text("__global__ void k() { /* changed */ }")
    assert passes_once_per_build("test", [source], check)
    assert len(calls) == 2  # a new build is checked again


def test_a_failure_is_checked_again(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_MESH_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "kernel.cu"
    source.write_text("x")
    check, calls = counting(False)
    assert not passes_once_per_build("test", [source], check)
    assert not passes_once_per_build("test", [source], check)
    assert len(calls) == 2


def test_the_cache_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_MESH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MOE_MESH_SELFCHECK_CACHE", "0")
    source = tmp_path / "kernel.cu"
    source.write_text("x")
    check, calls = counting(True)
    passes_once_per_build("test", [source], check)
    passes_once_per_build("test", [source], check)
    assert len(calls) == 2
