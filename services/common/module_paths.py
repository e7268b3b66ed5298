"""Modules of an MLX model named by dotted paths (`model.layers.3.mlp`, list indices included)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mlx import nn


def replace_modules(model: nn.Module, replacements: Mapping[str, nn.Module]) -> None:
    """Swap modules at dotted paths (list indices included), before weights load."""
    for path, new in replacements.items():
        *parents, leaf = path.split(".")
        owner: Any = model
        for part in parents:
            owner = owner[int(part)] if isinstance(owner, list) else getattr(owner, part)
        if isinstance(owner, list):
            owner[int(leaf)] = new
        else:
            setattr(owner, leaf, new)


def find_module(model: nn.Module, path: str) -> nn.Module:
    module: Any = model
    for part in path.split("."):
        module = module[int(part)] if isinstance(module, list) else getattr(module, part)
    return module
