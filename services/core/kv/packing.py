"""Bit packing of quantization indices into byte-aligned planes.

No index ever straddles a byte: an index of b bits is split into planes whose widths
divide 8 — 1 bit: [1]; 2: [2]; 3: [2 (low bits), 1 (high bit)]; 4: [4]. A plane of
width w stores 8/w consecutive coordinates per byte, coordinate j in bits
(j mod 8/w) * w of byte j // (8/w). The Metal kernels use the same layout
(metal/turboquant.metal), so a kernel thread decodes any coordinate with one load,
one shift and one mask.
"""

from __future__ import annotations

import mlx.core as mx

PLANE_WIDTHS = {1: (1,), 2: (2,), 3: (2, 1), 4: (4,)}


def packed_bytes(bits: int, size: int) -> int:
    """Bytes per vector of `size` coordinates at `bits` bits (size a multiple of 8)."""
    return sum(size * width // 8 for width in PLANE_WIDTHS[bits])


def _shifts(width: int) -> mx.array:
    return mx.arange(0, 8, width, dtype=mx.uint8)


def pack_plane(values: mx.array, width: int) -> mx.array:
    """uint8 values < 2**width, shape [..., P] -> uint8 [..., P * width / 8]."""
    per_byte = 8 // width
    grouped = values.astype(mx.uint8).reshape(*values.shape[:-1], -1, per_byte)
    return mx.sum(grouped << _shifts(width), axis=-1).astype(mx.uint8)


def unpack_plane(plane: mx.array, width: int) -> mx.array:
    """Inverse of pack_plane: uint8 [..., B] -> uint8 [..., B * 8 / width]."""
    mask = (1 << width) - 1
    spread = (plane[..., None] >> _shifts(width)) & mask
    return spread.reshape(*plane.shape[:-1], -1)


def pack_indices(indices: mx.array, bits: int) -> mx.array:
    """uint8 indices [..., P] -> one byte row [..., packed_bytes(bits, P)]: the planes of
    PLANE_WIDTHS[bits] one after another (low bits first)."""
    planes, low = [], 0
    for width in PLANE_WIDTHS[bits]:
        planes.append(pack_plane((indices >> low) & ((1 << width) - 1), width))
        low += width
    return planes[0] if len(planes) == 1 else mx.concatenate(planes, axis=-1)


def unpack_indices(codes: mx.array, bits: int) -> mx.array:
    out, low, start = None, 0, 0
    size = codes.shape[-1] * 8 // sum(PLANE_WIDTHS[bits])
    for width in PLANE_WIDTHS[bits]:
        stop = start + size * width // 8
        part = unpack_plane(codes[..., start:stop], width)
        out = part if out is None else out | (part << low)
        low += width
        start = stop
    return out
