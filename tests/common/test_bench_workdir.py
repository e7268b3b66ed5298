"""A bench's work folder (sockets, service logs) is removed when the bench ends, and kept,
with its path printed, when the bench dies of an exception (its logs say why)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_bench(body: str) -> tuple[list[Path], subprocess.CompletedProcess]:
    """Runs a bench-like script that makes a work folder with a log in it, then `body`;
    returns the folders it printed and the finished process."""
    script = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
        "from bench.workdir import bench_workdir\n"
        "work = bench_workdir('mm-wdtest-')\n"
        "(work / 'core.log').write_text('log')\n"
        "print(work, flush=True)\n"
    ) + body
    done = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=60
    )
    return [Path(line) for line in done.stdout.splitlines()], done


@pytest.mark.slow
def test_every_folder_is_removed_when_the_bench_ends():
    folders, done = run_bench("print(bench_workdir('mm-wdtest-'), flush=True)\n")
    assert done.returncode == 0 and len(folders) == 2
    assert not any(folder.exists() for folder in folders)


@pytest.mark.slow
def test_the_folder_is_kept_and_named_when_the_bench_dies():
    folders, done = run_bench("raise RuntimeError('worker never came up')\n")
    try:
        assert done.returncode != 0
        assert (folders[0] / "core.log").read_text() == "log"
        assert f"logs kept in {folders[0]}" in done.stderr
    finally:
        shutil.rmtree(folders[0], ignore_errors=True)
