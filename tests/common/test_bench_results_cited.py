"""Every file in bench/results is a current figure that the docs cite: a result file nothing cites is
history, which git keeps, or a figure the docs forgot. There is one file per bench and machine,
`<bench>-<machine>.json`; several current runs of one bench on one machine share it under "runs"."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CITED_IN = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
JSON_NAME = re.compile(r"[\w.*-]+\.json")
# machine: cpu = the 2-core x86 VM, h200 / h100 = the GPU machines, h200host = the H200 machine's 16-core CPU.
RESULT_NAME = re.compile(r"^[a-z_]+-(cpu|h100|h200|h200host)\.json$")


def cited_names() -> set[str]:
    """The .json names the docs mention, with `*` where they name a family of files."""
    return {name for doc in CITED_IN for name in JSON_NAME.findall(doc.read_text())}


def is_cited(file_name: str, names: set[str]) -> bool:
    return file_name in names or any("*" in n and fnmatch.fnmatchcase(file_name, n) for n in names)


def test_every_bench_result_file_is_cited_by_the_docs():
    names = cited_names()
    results = sorted(p.name for p in (ROOT / "bench" / "results").glob("*.json"))
    assert results, "bench/results holds no result files"
    uncited = [name for name in results if not is_cited(name, names)]
    assert not uncited, f"no doc cites these result files (cite them or remove them): {uncited}"


def test_one_result_file_per_bench_and_machine():
    results = sorted(p.name for p in (ROOT / "bench" / "results").iterdir())
    assert results, "bench/results holds no result files"
    misnamed = [name for name in results if not RESULT_NAME.match(name)]
    assert not misnamed, (
        f"name result files <bench>-<machine>.json (machine: cpu, h100, h200 or h200host), one per bench and "
        f"machine, with several runs under 'runs'; git keeps superseded ones: {misnamed}"
    )


def test_every_result_file_the_docs_name_exists():
    results = {p.name for p in (ROOT / "bench" / "results").glob("*.json")}
    benches = {p.stem for p in (ROOT / "bench").glob("*.py")}
    named = {n for n in cited_names() if n.split("-")[0] in benches}  # <bench>-<machine>….json
    missing = sorted(
        n for n in named if not any(fnmatch.fnmatchcase(r, n) if "*" in n else r == n for r in results)
    )
    assert not missing, f"the docs cite result files that are not in bench/results: {missing}"


def test_a_family_pattern_cites_its_members_only():
    names = {"kv_rotations-h200-*.json", "decode-h200.json"}
    assert is_cited("kv_rotations-h200-seeds.json", names)
    assert is_cited("decode-h200.json", names)
    assert not is_cited("kv_rotations-h200.json", names)
    assert not is_cited("decode-cpu.json", names)
