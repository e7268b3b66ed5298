"""A safetensors file's header, checked before MLX maps the file.

A safetensors file is an 8-byte little-endian header length N, N bytes of a JSON object, then
the data. Each entry names a dtype, a shape and the [begin, end) of its bytes within the data;
`__metadata__` maps strings to strings. A checkpoint cut short by a failed download, or a file
that is not what its name says, then fails here with the file and the entry at fault, before
any tensor is read.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

MAX_HEADER_BYTES = 100 * 1000 * 1000  # the format's own limit
_ITEM_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "C64": 8,
}  # the dtypes MLX's loader reads, and their sizes


class SafetensorsHeaderError(ValueError):
    """The file is not a well-formed safetensors file; the message names it and what is wrong."""


def check_safetensors(path: Path) -> dict[str, tuple[str, list[int]]]:
    """The tensors `path` holds, as {name: (dtype, shape)}; SafetensorsHeaderError otherwise."""
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as file:
        prefix = file.read(8)
        length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else 0
        head = prefix + file.read(min(length, MAX_HEADER_BYTES, max(size - 8, 0)))
    return parse_header(head, size, str(path))  # it judges the length, and what was read


def parse_header(head: bytes, file_size: int, name: str) -> dict[str, tuple[str, list[int]]]:
    """The entries of the header that `head` (the file's first bytes) holds, for a file of
    `file_size` bytes named `name` in messages."""
    if len(head) < 8:
        raise SafetensorsHeaderError(f"{name}: too short for a safetensors header")
    (length,) = struct.unpack("<Q", head[:8])
    if length > min(MAX_HEADER_BYTES, file_size - 8) or len(head) < 8 + length:
        raise SafetensorsHeaderError(
            f"{name}: its header claims {length} bytes, more than the file's {file_size} bytes or the "
            f"format's limit of {MAX_HEADER_BYTES} (a file cut short, or not safetensors)"
        )
    try:
        header = json.loads(head[8 : 8 + length])
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise SafetensorsHeaderError(f"{name}: the header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise SafetensorsHeaderError(f"{name}: the header is not a JSON object")
    data_bytes = file_size - 8 - length
    tensors = {}
    for key, entry in header.items():
        if key == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise SafetensorsHeaderError(f"{name}: __metadata__ must map strings to strings")
            continue
        tensors[key] = _entry(entry, data_bytes, f"{name}: tensor {key!r}")
    return tensors


def _entry(entry, data_bytes: int, where: str) -> tuple[str, list[int]]:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise SafetensorsHeaderError(f"{where}: expected an object of dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str):
        raise SafetensorsHeaderError(f"{where}: dtype must be a string")
    if not isinstance(shape, list) or not all(_count(d) for d in shape):
        raise SafetensorsHeaderError(f"{where}: shape must be a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_count(o) for o in offsets):
        raise SafetensorsHeaderError(f"{where}: data_offsets must be [begin, end]")
    begin, end = offsets
    if not begin <= end <= data_bytes:
        raise SafetensorsHeaderError(
            f"{where}: bytes [{begin}, {end}) lie outside the file's {data_bytes} bytes of data "
            "(a file cut short?)"
        )
    item = _ITEM_BYTES.get(dtype)
    if item is None:
        raise SafetensorsHeaderError(
            f"{where}: dtype {dtype!r} is not one MLX reads ({', '.join(_ITEM_BYTES)})"
        )
    if math.prod(shape) * item != end - begin:
        raise SafetensorsHeaderError(
            f"{where}: {dtype} {shape} needs {math.prod(shape) * item} bytes, its offsets span {end - begin}"
        )
    return dtype, shape


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62
