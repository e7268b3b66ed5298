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
import numpy as np

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


# ---- decoding by table lookup -----------------------------------------------------------
#
# Decoding coordinate by coordinate (shift, mask, combine planes, gather a centroid) costs
# about ten array ops per coordinate. Instead, a fixed group of coordinates is decoded
# with one gather from a small table that holds the decoded values of every bit pattern
# the group can have: a byte of a 1-, 2- or 4-bit plane (8, 4 or 2 coordinates), or for
# 3 bits the byte of the 2-bit plane plus the matching nibble of the 1-bit plane (4
# coordinates, 4096 patterns). The values are the codebook's own floats, so the result
# is identical to looking each index up separately.


def group_size(bits: int) -> int:
    """Coordinates decoded by one table row."""
    return {1: 8, 2: 4, 3: 4, 4: 2}[bits]


def lookup_table(bits: int, levels: np.ndarray) -> np.ndarray:
    """[patterns, group_size(bits)] float32: row g holds levels[index] for each coordinate
    of a group whose packed bits read g (see `group_patterns`)."""
    size = group_size(bits)
    patterns = np.arange(4096 if bits == 3 else 256)
    if bits == 3:
        low, high = patterns & 255, patterns >> 8
        index = [((low >> (2 * t)) & 3) | (((high >> t) & 1) << 2) for t in range(size)]
    else:
        index = [(patterns >> (bits * t)) & ((1 << bits) - 1) for t in range(size)]
    return np.asarray(levels, dtype=np.float32)[np.stack(index, axis=-1)]


_NIBBLE_SHIFTS = (0, 4)


def group_patterns(codes: mx.array, bits: int) -> mx.array:
    """The table row of every group: uint8 [..., P / group_size] (int32 for 3 bits)."""
    if bits != 3:
        return codes
    quarter = codes.shape[-1] * 2 // 3  # P / 4 bytes of the 2-bit plane, then P / 8
    low, high = codes[..., :quarter], codes[..., quarter:]
    nibbles = (high[..., None] >> mx.array(_NIBBLE_SHIFTS, dtype=mx.uint8)) & 15
    nibbles = nibbles.reshape(*high.shape[:-1], quarter).astype(mx.int32)
    return low.astype(mx.int32) | (nibbles << 8)


def lookup_decode(codes: mx.array, bits: int, table: mx.array) -> mx.array:
    """table values of every coordinate: uint8 codes [..., bytes] -> [..., P]."""
    groups = group_patterns(codes, bits)
    return table[groups].reshape(*groups.shape[:-1], groups.shape[-1] * group_size(bits))
