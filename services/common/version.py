"""moe-mesh's own version: the installed distribution's, or "unknown" when run from a source
tree that was never installed."""

from __future__ import annotations

from importlib import metadata


def moe_mesh_version() -> str:
    try:
        return metadata.version("moe-mesh")
    except metadata.PackageNotFoundError:
        return "unknown"
