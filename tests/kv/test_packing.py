"""Bit planes: lossless, byte-aligned, and laid out as the Metal kernels read them."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from services.core.kv.packing import pack_indices, packed_bytes, unpack_indices


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_pack_unpack_round_trip(bits):
    indices = mx.array(np.random.default_rng(bits).integers(0, 2**bits, size=(3, 2, 5, 64)).astype(np.uint8))
    codes = pack_indices(indices, bits)
    assert codes.dtype == mx.uint8 and codes.shape == (3, 2, 5, packed_bytes(bits, 64))
    assert mx.array_equal(unpack_indices(codes, bits), indices)


def test_three_bit_layout_is_a_two_bit_plane_then_a_one_bit_plane():
    P, j = 16, 9
    indices = np.zeros(P, dtype=np.uint8)
    indices[j] = 0b110  # low bits 0b10, high bit 1
    codes = np.array(pack_indices(mx.array(indices), 3))
    expected = np.zeros(P // 4 + P // 8, dtype=np.uint8)
    expected[j // 4] = 0b10 << (2 * (j % 4))  # 2-bit plane: 4 coordinates per byte
    expected[P // 4 + j // 8] = 1 << (j % 8)  # 1-bit plane: 8 per byte
    assert codes.tolist() == expected.tolist()


def test_packed_sizes():
    assert [packed_bytes(b, 128) for b in (1, 2, 3, 4)] == [16, 32, 48, 64]
