"""The version floors in pyproject.toml are true: the lowest versions they allow install together
into a fresh environment (pip constraints pin every direct dependency to its floor), and every
module of every service imports and the CLI runs there."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def floor_constraints() -> list[str]:
    """`name==floor` for each runtime dependency of this platform that states a `>=` floor."""
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = []
    for line in dependencies:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        floors = [spec.version for spec in requirement.specifier if spec.operator == ">="]
        assert floors, f"{line}: every dependency states its lowest version"
        pins.append(f"{requirement.name}=={floors[0]}")
    return pins


def test_every_dependency_states_a_floor():
    assert any(pin.startswith("mlx-lm==") for pin in floor_constraints())


def test_lowest_allowed_versions_install_and_import(tmp_path):
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("\n".join(floor_constraints()) + "\n")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "-c", str(constraints), str(ROOT)],
        check=False,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    if (
        install.returncode != 0
        and "No matching distribution" in install.stderr
        and "Could not fetch" in install.stderr
    ):
        pytest.skip(f"the package index cannot be reached: {install.stderr.strip().splitlines()[-1]}")
    assert install.returncode == 0, install.stderr[-4000:]
    modules = sorted(
        ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for path in (ROOT / "services").rglob("*.py")
        if path.name != "__init__.py" and "proto" not in path.parts
    )
    # outside the checkout, so the installed package is what imports
    imported = subprocess.run(
        [
            str(python),
            "-c",
            "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)",
            *modules,
        ],
        check=False,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )
    assert imported.returncode == 0, imported.stderr[-4000:]
    version = subprocess.run(
        [str(venv / "bin" / "moe-mesh"), "--version"],
        check=False,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert version.returncode == 0 and version.stdout.startswith("moe-mesh "), version.stderr
    listed = subprocess.run(
        [str(python), "-m", "pip", "list", "--format=freeze"], check=False, capture_output=True, text=True
    )
    installed = {
        canonicalize_name(n): Version(v) for n, v in (line.split("==") for line in listed.stdout.split())
    }
    for pin in floor_constraints():
        name, floor = pin.split("==")
        assert installed[canonicalize_name(name)] == Version(floor), pin
