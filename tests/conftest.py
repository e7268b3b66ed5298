from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

# Tests compare float32 results at 1e-4; MLX's CUDA backend would round float32 matmuls through
# TF32 (~1e-3) unless told not to, before MLX is first imported (the services below import it).
os.environ.setdefault("MLX_ENABLE_TF32", "0")

import mlx.core as mx
import pytest

from services.tools.split import split_checkpoint
from services.tools.synthetic_model import TINY_CONFIGS, build_random_checkpoint
from tests.helpers import remove_short_dirs, short_dir

# What a full run keeps on the temporary folder's disk at once: checkpoints, splits and the demo model
# (its test folders go as tests pass: pyproject's tmp_path_retention_policy).
RUN_DISK_BYTES = 5 << 30


def pytest_report_header(config):
    """The temporary folder's free space, and a plain warning where a full run will not fit in it."""
    folder = tempfile.gettempdir()
    free = shutil.disk_usage(folder).free
    line = (
        f"moe-mesh: {free / 2**30:.1f} GB free in {folder}; a full run needs about {RUN_DISK_BYTES >> 30} GB"
    )
    if free < RUN_DISK_BYTES:
        line += " (too little: tests that build models will fail with 'No space left on device')"
    return [line]


class TinyModels:
    """Tiny random checkpoints and their splits, built once per session on demand."""

    def __init__(self, root: Path):
        self.root = root

    # weight variants: (matrices' dtype, 1-D parameters' dtype)
    DTYPES = {None: (mx.float32, mx.float32), "bf16-f32-norms": (mx.bfloat16, mx.float32)}

    def checkpoint(self, arch: str, bits: int | None, dtypes: str | None = None) -> Path:
        path = self.root / f"{arch}-{bits or 'f32'}{'-' + dtypes if dtypes else ''}"
        if not (path / "config.json").exists():
            dtype, vector_dtype = self.DTYPES[dtypes]
            build_random_checkpoint(
                path, TINY_CONFIGS[arch], bits=bits, dtype=dtype, vector_dtype=vector_dtype
            )
        return path

    def split(self, arch: str, bits: int | None, dtypes: str | None = None) -> Path:
        checkpoint = self.checkpoint(arch, bits, dtypes)
        path = checkpoint.with_name(checkpoint.name + "-split")
        if not (path / "manifest.json").exists():
            split_checkpoint(checkpoint, path, progress=False)
        return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture
def short_tmp(tmp_path_factory):
    """A short folder for Unix sockets (their paths are limited to ~107 bytes)."""
    import shutil

    path = short_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _remove_short_dirs_at_the_end():
    yield
    remove_short_dirs()
