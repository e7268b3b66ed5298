"""moe-mesh's processes never import PyTorch, even where it is installed: transformers would
import it at start-up (seconds on a CUDA machine) and prefer its torch-backed processors.

An installed "torch" is stood in for by a package that fails when imported, with the metadata
transformers reads to decide that torch is there."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import core_args, spawn, stop, wait_serving

pytestmark = pytest.mark.slow  # interpreters importing mlx-lm and transformers

# what every service imports, and what their model and image code imports in turn
SERVICE_IMPORTS = (
    "import services.core.server, services.experts.server, services.gateway.server; "
    "import mlx_lm, mlx_vlm, transformers.modeling_rope_utils; "
    "from transformers import AutoProcessor; import sys; "
    "assert sys.modules['torch'] is None, sys.modules['torch']"
)


@pytest.fixture(scope="module")
def torch_installed(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text("raise RuntimeError('torch was imported')\n")
    info = site / "torch-2.9.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.9.0\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}


def python(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=120
    )


def test_transformers_would_import_the_installed_torch(torch_installed):
    out = python("import mlx_lm", torch_installed)
    assert out.returncode != 0 and "torch was imported" in out.stderr


def test_the_services_never_import_it(torch_installed):
    out = python(f"import services.ops.cli; {SERVICE_IMPORTS}", torch_installed)
    assert out.returncode == 0, out.stderr[-2000:]


def test_core_serves_with_it_installed(torch_installed, tiny_models, short_tmp):
    split = tiny_models.split("qwen3_moe", None)
    address, log = f"unix:{short_tmp / 'core.sock'}", short_tmp / "core.log"
    env = {"PYTHONPATH": torch_installed["PYTHONPATH"]}
    core = spawn(core_args(split, address, ["local"]), log, env=env)
    try:
        wait_serving(address, core, log_path=log)
    finally:
        stop([core])


def test_moe_mesh_allow_torch_lets_it_be_imported(torch_installed):
    out = python("import services.ops.cli, mlx_lm", {**torch_installed, "MOE_MESH_ALLOW_TORCH": "1"})
    assert out.returncode != 0 and "torch was imported" in out.stderr
