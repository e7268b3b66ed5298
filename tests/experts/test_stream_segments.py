"""Records read in parallel segments: exact bytes in every layout and mode, failures named, store unharmed."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from services.common import tensor_codec
from services.common.manifest import Manifest
from services.experts.compute import ExpertCompute
from services.experts.io import DIRECT_IO_ALIGNMENT, ExpertFileError, RecordRead, RecordReader, aligned_buffer
from services.experts.store import ResidentExpertStore
from services.experts.streaming_store import StreamingExpertStore, expert_bytes
from services.proto.moemesh.v1 import expert_pb2


def targets_for(layer, aligned: bool) -> list[tuple[int, np.ndarray]]:
    """One destination per tensor: page-aligned (read into directly) or 8 bytes off (staged)."""
    out = []
    for tensor in layer.tensors:
        if aligned:
            out.append((tensor.offset, aligned_buffer(tensor.nbytes)))
        else:
            out.append((tensor.offset, aligned_buffer(tensor.nbytes + 8)[8:]))
    return out


@pytest.mark.parametrize("mode", ["direct", "buffered"])
@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("min_segment_bytes", [0, 4096])
def test_segmented_reads_land_every_tensor_byte_for_byte(tiny_models, mode, aligned, min_segment_bytes):
    split = tiny_models.split("mixtral", None)  # float32: 16 KiB tensors, page multiples
    manifest = Manifest.load(split)
    layer = manifest.layer(1)
    data = (split / layer.file).read_bytes()
    with RecordReader(split, [layer], mode=mode, threads=4, min_segment_bytes=min_segment_bytes) as reader:
        for experts in ([3], [0, 7], [1, 2, 4, 5, 6]):
            reads = [RecordRead(1, e, targets_for(layer, aligned)) for e in experts]
            segments = reader.segments(reads)
            if min_segment_bytes:  # few misses are cut into pieces to keep ~4 reads in flight
                assert len(segments) >= min(4, 12 * len(reads))
            else:
                assert len(segments) == len(reads)
            nbytes, seconds, failures = reader.read_many(reads)
            assert failures == [] and seconds > 0
            assert nbytes == len(reads) * expert_bytes(layer)
            for read in reads:
                base = read.expert * layer.record_size
                for start, target in read.targets:
                    expected = data[base + start : base + start + target.nbytes]
                    assert target.tobytes() == expected, f"expert {read.expert} at {start}"


def test_segments_cover_each_record_once_on_page_boundaries(tiny_models):
    split = tiny_models.split("mixtral", None)
    layer = Manifest.load(split).layer(0)
    with RecordReader(split, [layer], mode="direct", threads=8, min_segment_bytes=8192) as reader:
        for count, per_record in ((1, 6), (2, 4), (3, 3), (8, 1)):  # 48 KiB records, >= 8 KiB pieces
            reads = [RecordRead(0, e, targets_for(layer, True)) for e in range(count)]
            segments = reader.segments(reads)
            for read in reads:
                mine = sorted((s.start, s.stop) for s in segments if s.read is read)
                assert len(mine) == per_record
                assert mine[0][0] == 0 and mine[-1][1] == layer.record_size
                assert all(a[1] == b[0] for a, b in zip(mine, mine[1:], strict=False))
                assert all(start % DIRECT_IO_ALIGNMENT == 0 for start, _ in mine)


def decode_call(manifest: Manifest, layer: int, experts: list[int], seed: int = 0) -> expert_pb2.ExpertCall:
    hidden = np.random.RandomState(seed).normal(size=(1, manifest.hidden_size)).astype(np.float32)
    return expert_pb2.ExpertCall(
        call_id=seed,
        layer=layer,
        hidden=tensor_codec.encode(mx.array(hidden)),
        expert_ids=tensor_codec.encode(mx.array(np.array([experts], dtype=np.int32))),
    )


@pytest.fixture
def float32_split(tiny_models, tmp_path) -> Path:
    """A private copy of the float32 mixtral split (its 48 KiB records make several segments)."""
    copy = tmp_path / "split"
    shutil.copytree(tiny_models.split("mixtral", None), copy)
    return copy


def segmented_store(split: Path, manifest: Manifest, io_mode: str = "direct") -> StreamingExpertStore:
    return StreamingExpertStore(
        split,
        manifest,
        {1: list(range(8))},
        3 * expert_bytes(manifest.layer(1)),
        io_mode=io_mode,
        io_threads=4,
        min_segment_bytes=4096,
    )


@pytest.mark.parametrize("io_mode", ["direct", "buffered"])
def test_short_segment_fails_that_call_naming_file_and_expert(float32_split, io_mode):
    manifest = Manifest.load(float32_split)
    layer = manifest.layer(1)
    owned = {1: list(range(8))}
    reference = ExpertCompute(ResidentExpertStore(float32_split, manifest, owned))
    store = segmented_store(float32_split, manifest, io_mode)
    compute = ExpertCompute(store)
    with open(float32_split / layer.file, "r+b") as f:
        f.truncate(6 * layer.record_size + 4096)  # expert 6 keeps its first page only; 7 is gone
    for lost in (6, 7):
        with pytest.raises(ExpertFileError, match=rf"layer_001\.bin: short read of expert {lost} of layer 1"):
            compute.run(decode_call(manifest, 1, [0, lost]))
        assert not store.is_resident(1, lost)
    assert store.stats().read_failures == 2
    for experts in ([0, 5], [2, 3], [4, 1]):  # still serving, and evicting, with exact outputs
        call = decode_call(manifest, 1, experts, seed=experts[0])
        assert compute.run(call).output.data == reference.run(call).output.data
    store.close()


def test_failed_segment_read_fails_only_its_expert_and_the_slot_is_reused(float32_split, monkeypatch):
    manifest = Manifest.load(float32_split)
    layer = manifest.layer(1)
    reference = ExpertCompute(ResidentExpertStore(float32_split, manifest, {1: list(range(8))}))
    store = segmented_store(float32_split, manifest)
    compute = ExpertCompute(store)
    real_preadv = os.preadv
    bad_offset = 5 * layer.record_size + 2 * 4096 * 3  # the third of expert 5's four 12 KiB segments

    def failing_preadv(fd, buffers, offset, *args):
        if offset == bad_offset:
            raise OSError(errno.EIO, "Input/output error")
        return real_preadv(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", failing_preadv)
    with pytest.raises(
        ExpertFileError, match=rf"layer_001\.bin: reading expert 5 of layer 1 at offset {bad_offset}"
    ):
        compute.run(decode_call(manifest, 1, [5]))
    assert not store.is_resident(1, 5) and store.stats().read_failures == 1
    monkeypatch.setattr(os, "preadv", real_preadv)  # the disk recovers: the same expert reads fine
    for experts in ([5], [5, 6], [0, 7, 1]):
        call = decode_call(manifest, 1, experts, seed=len(experts))
        assert compute.run(call).output.data == reference.run(call).output.data
    assert store.is_resident(1, 5) or store.stats().evictions > 0
    store.close()
