"""Host staging: uploads through reused buffers keep every array's bytes, however late it is read."""

import os

import mlx.core as mx
import numpy as np
import pytest

from services.common import host_staging, tensor_codec


@pytest.fixture
def staged(monkeypatch):
    """Staging on, as on MLX's CUDA backend (no memory advice off CUDA)."""
    stage = host_staging.HostStaging(advisor=None)
    monkeypatch.setattr(host_staging._PROCESS, "staging", stage)
    monkeypatch.setattr(host_staging._PROCESS, "decided", True)
    return stage


def test_off_where_memory_is_shared():
    if mx.cuda.is_available() or os.environ.get("MOE_MESH_HOST_STAGING"):
        pytest.skip("this process runs on MLX's CUDA backend, or its staging is set by hand")
    assert host_staging.staging() is None


def test_lazy_readers_keep_their_bytes_when_the_buffers_are_reused(staged):
    rng = np.random.default_rng(0)
    hosts = [rng.standard_normal((3, 700)).astype(np.float32) for _ in range(7)]
    # every upload of this size shares two buffers; none of the readers is evaluated yet
    readers = [staged.upload(h).view(mx.float32).reshape(3, 700) * 2 for h in hosts]
    for host, reader in zip(hosts, readers, strict=True):
        assert np.array_equal(np.array(reader), host * 2)


def test_sizes_and_the_plain_path(staged):
    for nbytes in (1, 4095, 4096, 4097, 100_000, (4 << 20) + 1):  # the last: over the cap, plain
        host = np.arange(nbytes, dtype=np.uint8)
        assert np.array_equal(np.array(staged.upload(host)), host)
    assert np.array(staged.upload(np.zeros(0, np.uint8))).size == 0


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_codec_round_trips_through_staging(staged, dtype):
    hidden = mx.random.normal((5, 64)).astype(dtype)
    host = tensor_codec.numpy_view(hidden)
    ids = np.arange(10, dtype=np.int32).reshape(5, 2)
    device_hidden, device_ids = tensor_codec.to_mlx_with_ids(host, ids)
    assert device_hidden.dtype == dtype and device_ids.dtype == mx.int32
    assert mx.array_equal(device_hidden, hidden).item()
    assert np.array_equal(np.array(device_ids), ids)
    again = tensor_codec.to_mlx(host)
    assert again.dtype == dtype and mx.array_equal(again, hidden).item()
