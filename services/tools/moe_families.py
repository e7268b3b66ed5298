"""The MoE families the installed mlx-lm provides, and a tiny random config for each.

A family is an `mlx_lm.models` module with a `Model` whose code reaches mlx-lm's
`switch_layers` (SwitchGLU/SwitchMLP) through its own imports: read from mlx-lm's
sources, so a family mlx-lm adds is listed without anyone naming it here.

`tiny_config(family)` fills the family's `ModelArgs` from one table of small sizes,
keyed by field name, so most families need no entry of their own; `FAMILY_CONFIGS`
holds what a family needs beyond that (MoE switched on, layer patterns, wrappers
that nest a text config).
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import importlib
from functools import cache
from pathlib import Path
from typing import Any

from services.tools.synthetic_model import TINY_CONFIGS
from services.tools.tiny_family_configs import FAMILY_CONFIGS, SIZES


def _models_root() -> Path:
    import mlx_lm.models

    return Path(mlx_lm.models.__file__).parent


def _relative_imports(root: Path, name: str) -> set[str]:
    try:
        tree = ast.parse((root / f"{name}.py").read_text())
    except (FileNotFoundError, SyntaxError):
        return set()
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
    return found


@cache
def mlx_lm_moe_families() -> tuple[str, ...]:
    """Every mlx-lm model type whose architecture has routed experts, sorted."""
    root = _models_root()
    families = []
    for path in sorted(root.glob("*.py")):
        name = path.stem
        if name in ("__init__", "switch_layers") or "class Model(" not in path.read_text():
            continue
        seen, todo = set(), [name]
        while todo:
            module = todo.pop()
            if module not in seen:
                seen.add(module)
                todo.extend(_relative_imports(root, module))
        if "switch_layers" in seen:
            families.append(name)
    return tuple(families)


def _required_fields(family: str) -> dict[str, dataclasses.Field]:
    module = importlib.import_module(f"mlx_lm.models.{family}")
    return {field.name: field for field in dataclasses.fields(module.ModelArgs)}


def tiny_config(family: str) -> dict[str, Any]:
    """A small random-weight config of `family`, with its routed experts switched on."""
    if family in TINY_CONFIGS and family not in FAMILY_CONFIGS:
        return copy.deepcopy(TINY_CONFIGS[family])
    extra = FAMILY_CONFIGS.get(family, {})
    if "text_config" in extra:  # a wrapper: its text model's family builds the inner config
        text = extra["text_config"]
        inner = tiny_config(text["family"]) | {k: v for k, v in text.items() if k != "family"}
        return {
            "model_type": family,
            **{k: v for k, v in extra.items() if k != "text_config"},
            "text_config": inner,
        }
    config: dict[str, Any] = {"model_type": extra.get("model_type", family)}
    missing = []
    for name, field in _required_fields(family).items():
        if name in SIZES:
            config[name] = SIZES[name]
        elif name in extra or name == "model_type":
            continue
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            missing.append(name)
    if missing:
        raise KeyError(f"{family}: no tiny value for required fields {missing}")
    config.update({k: v for k, v in extra.items() if k != "model_type"})
    return config
