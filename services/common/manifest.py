"""The split checkpoint's manifest: what core and every worker agree on.

`manifest.json` names the model (fingerprint, config), every MoE layer's expert
module path, and the fixed-size record layout of `experts/layer_NNN.bin`:
expert e of layer l is the `record_size` bytes at offset `e * record_size`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from services.common.tensor_codec import MLX_DTYPE_BY_NAME

FORMAT = "moe-mesh-split/1"
RECORD_ALIGNMENT = 16 * 1024  # records start on 16 KiB boundaries (direct I/O, NVMe pages)
TENSOR_ALIGNMENT = 64  # tensors inside a record start on 64-byte boundaries


class ManifestError(ValueError):
    pass


@dataclass(frozen=True)
class ExpertTensor:
    name: str  # inside the expert module, e.g. "gate_proj.weight"
    dtype: str  # MLX dtype name
    shape: list[int]  # one expert's shape (the stacked tensor without its leading E)
    offset: int  # byte offset inside the record
    nbytes: int

    @property
    def mlx_dtype(self) -> mx.Dtype:
        return MLX_DTYPE_BY_NAME[self.dtype]

    @property
    def numpy_dtype(self) -> np.dtype:
        # bf16 has no numpy dtype: its bytes travel as uint16 and are viewed back in MLX.
        return np.dtype("<u2") if self.dtype == "bfloat16" else np.dtype(self.dtype)


@dataclass(frozen=True)
class MoeLayer:
    layer: int
    module: str  # dotted path of the expert module in the mlx-lm model
    num_experts: int
    file: str  # relative to the split folder
    record_size: int
    tensors: list[ExpertTensor]

    @property
    def file_size(self) -> int:
        return self.num_experts * self.record_size


@dataclass(frozen=True)
class Manifest:
    fingerprint: str
    model_type: str
    config: dict
    hidden_size: int
    num_experts: int
    layers: list[MoeLayer]
    format: str = FORMAT
    alignment: int = RECORD_ALIGNMENT
    source: str = ""
    dtype: str = "float32"  # activation dtype on the wire
    extra: dict = field(default_factory=dict)

    def layer(self, index: int) -> MoeLayer:
        for layer in self.layers:
            if layer.layer == index:
                return layer
        raise KeyError(index)

    @property
    def layer_indices(self) -> list[int]:
        return [layer.layer for layer in self.layers]

    @property
    def experts_per_token(self) -> int:
        return experts_per_token(self.config)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1))

    def model_id(self, split_dir: Path) -> str:
        """The name clients use for this model: the source checkpoint's repo id where it came from
        the Hugging Face cache, else its folder name."""
        from services.common.model_source import model_name

        return model_name(Path(self.source)) if self.source else Path(split_dir).name

    @classmethod
    def load(cls, split_dir: Path) -> Manifest:
        path = Path(split_dir) / "manifest.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ManifestError(
                f"{split_dir} is not a moe-mesh split (no manifest.json); run `moe-mesh split`"
            ) from None
        except json.JSONDecodeError as error:
            raise ManifestError(f"{path} is not valid JSON: {error}") from None
        if raw.get("format") != FORMAT:
            raise ManifestError(f"{path}: format {raw.get('format')!r}, expected {FORMAT!r}")
        layers = [
            MoeLayer(**{**l, "tensors": [ExpertTensor(**t) for t in l["tensors"]]}) for l in raw.pop("layers")
        ]
        return cls(layers=layers, **raw)


def experts_per_token(config: dict) -> int:
    """The router's top-k, whatever the architecture's config calls it (1 if it names none)."""
    text = {**config, **(config.get("text_config") or {})}
    for key in ("num_experts_per_tok", "moe_topk", "top_k", "experts_per_token"):
        if key in text:
            return int(text[key])
    return 1


def record_layout(tensors: list[tuple[str, str, list[int], int]]) -> tuple[list[ExpertTensor], int]:
    """Place (name, dtype, shape, nbytes) tensors in a record; return them and the record size."""
    placed, offset = [], 0
    for name, dtype, shape, nbytes in tensors:
        offset = math.ceil(offset / TENSOR_ALIGNMENT) * TENSOR_ALIGNMENT
        placed.append(ExpertTensor(name, dtype, list(shape), offset, nbytes))
        offset += nbytes
    return placed, max(RECORD_ALIGNMENT, math.ceil(offset / RECORD_ALIGNMENT) * RECORD_ALIGNMENT)
