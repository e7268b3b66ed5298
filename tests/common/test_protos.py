"""The committed generated code is exactly what protoc makes from protos/."""

from __future__ import annotations

from pathlib import Path

from services.proto.regenerate import regenerate

GENERATED = Path(__file__).resolve().parents[2] / "services" / "proto"


def test_generated_code_is_up_to_date(tmp_path):
    regenerate(tmp_path)
    fresh = {p.relative_to(tmp_path): p.read_text() for p in (tmp_path / "moemesh").rglob("*") if p.is_file()}
    committed = {
        p.relative_to(GENERATED): p.read_text()
        for p in (GENERATED / "moemesh").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert sorted(fresh) == sorted(committed), (
        "generated files differ: run `python -m services.proto.regenerate`"
    )
    stale = [str(name) for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale generated code in {stale}: run `python -m services.proto.regenerate`"
    assert all(text.startswith("# Generated from protos/") for text in committed.values())
