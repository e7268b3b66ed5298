"""The split checkpoint's manifest: what core and every worker agree on.

`manifest.json` names the model (fingerprint, config), every MoE layer's expert
module path, and the fixed-size record layout of `experts/layer_NNN.bin`:
expert e of layer l is the `record_size` bytes at offset `e * record_size`.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

import mlx.core as mx
import numpy as np

from services.common.model_shape import with_text_config
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
            text = path.read_bytes()
        except FileNotFoundError:
            raise ManifestError(
                f"{split_dir} is not a moe-mesh split (no manifest.json); run `moe-mesh split`"
            ) from None
        return cls.from_json(text, path)

    @classmethod
    def from_json(cls, text: bytes | str, path: Path | str) -> Manifest:
        """The manifest in `text` (read from `path`, which messages name); ManifestError for
        anything that is not a manifest this version reads, naming the field at fault."""
        try:
            raw = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ManifestError(f"{path} is not valid JSON: {error}") from None
        if not isinstance(raw, dict):
            raise ManifestError(f"{path}: expected a JSON object, got {type(raw).__name__}")
        if raw.get("format") != FORMAT:
            raise ManifestError(f"{path}: format {raw.get('format')!r}, expected {FORMAT!r}")
        return _ManifestReader(str(path)).manifest(raw)


class _ManifestReader:
    """Checks each field's type and range as it builds the dataclasses."""

    def __init__(self, path: str):
        self.path = path

    def fail(self, where: str, message: str):
        raise ManifestError(f"{self.path}: {where}: {message}")

    def fields(self, raw, kind: type, where: str) -> None:
        """`raw` is an object holding `kind`'s fields, each of its type."""
        if not isinstance(raw, dict):
            self.fail(where, "expected an object")
        names = {f.name for f in fields(kind)}
        unknown = sorted(set(raw) - names)
        if unknown:
            self.fail(where, f"unknown field(s) {', '.join(map(str, unknown))}")
        required = {f.name for f in fields(kind) if f.default is MISSING and f.default_factory is MISSING}
        missing = sorted(required - set(raw))
        if missing:
            self.fail(where, f"missing field(s) {', '.join(missing)}")
        for f in fields(kind):
            if f.name in raw:
                self.typed(raw[f.name], _FIELD_TYPES[f.type], f"{where}{f.name}")

    def typed(self, value, kind, where: str) -> None:
        if kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62
        elif kind is list:
            ok = isinstance(value, list)
        else:
            ok = isinstance(value, kind)
        if not ok:
            self.fail(
                where,
                f"expected {'a non-negative integer' if kind is int else kind.__name__}, got {value!r:.60}",
            )

    def manifest(self, raw: dict) -> Manifest:
        self.fields(raw, Manifest, "")
        layers = []
        for i, layer in enumerate(raw["layers"]):
            where = f"layers[{i}]."
            self.fields(layer, MoeLayer, where)
            tensors = []
            for j, tensor in enumerate(layer["tensors"]):
                tensor_where = f"{where}tensors[{j}]."
                self.fields(tensor, ExpertTensor, tensor_where)
                tensors.append(self.tensor(tensor, layer, tensor_where))
            layers.append(MoeLayer(**{**layer, "tensors": tensors}))
        if raw["hidden_size"] < 1 or raw["num_experts"] < 1:
            self.fail("hidden_size/num_experts", "must be at least 1")
        if raw.get("dtype", "float32") not in MLX_DTYPE_BY_NAME:
            self.fail("dtype", f"unknown dtype {raw['dtype']!r}")
        return Manifest(**{**raw, "layers": layers})

    def tensor(self, raw: dict, layer: dict, where: str) -> ExpertTensor:
        if raw["dtype"] not in MLX_DTYPE_BY_NAME:
            self.fail(where + "dtype", f"unknown dtype {raw['dtype']!r}")
        for d in raw["shape"]:
            self.typed(d, int, where + "shape")
        if raw["offset"] + raw["nbytes"] > layer["record_size"]:
            self.fail(
                where,
                f"bytes {raw['offset']}..{raw['offset'] + raw['nbytes']} overrun the record of {layer['record_size']}",
            )
        return ExpertTensor(**raw)


def experts_per_token(config: dict) -> int:
    """The router's top-k, whatever the architecture's config calls it (1 if it names none)."""
    text = with_text_config(config)
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


# the JSON type each dataclass field's annotation stands for (annotations are strings here)
_FIELD_TYPES = {
    "str": str,
    "int": int,
    "dict": dict,
    "list[int]": list,
    "list[ExpertTensor]": list,
    "list[MoeLayer]": list,
}
