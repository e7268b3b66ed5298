"""Reading expert records from the layer files: many at once, into memory that is reused.

`RecordReader` owns one file descriptor per layer file and a thread pool. `read_many`
issues every read of a call at once (the GIL is released inside `os.preadv`, so the
reads overlap in the kernel and on the device) and waits for all of them. A call that
misses only one or two experts leaves the device's queue nearly empty; with
`min_segment_bytes` > 0 each record is cut into page-aligned segments (at least that
big) until about `threads` reads are in flight, every segment landing directly in its
destination. Whether that helps depends on the disk (see DEFAULT_MIN_SEGMENT_BYTES).

Two modes, chosen by flag because the faster one depends on the machine:
- `buffered`: the page cache. `preadv` scatters each record straight into its
  destination buffers (one iovec per tensor), so there is no extra copy.
- `direct`: O_DIRECT on Linux, F_NOCACHE on macOS. O_DIRECT needs block-aligned
  memory: page-aligned destinations (the streaming store's slabs) are read into as
  they are; otherwise each thread reads into its own page-aligned staging buffer
  (allocated once, reused) and copies the tensors out (numpy's copy releases the GIL too).

Every layer file's size is checked against the manifest when it is opened, and
every read (every segment) must return exactly the bytes asked for: a truncated,
missing or unreadable file raises `ExpertFileError` naming the file and the expert,
and the destination of a failed read is never handed to the compute side.
"""

from __future__ import annotations

import errno
import mmap
import os
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.common.logging import get_logger
from services.common.manifest import MoeLayer

log = get_logger(__name__)

IO_MODES = ("direct", "buffered")
DEFAULT_IO_THREADS = 8
# 0: whole records. Segments pay only on a disk whose throughput grows with queue depth, and
# small ones cost CPU: measure a disk with `--io-segment-kb` (bench/stream.py's read-path replay
# compares settings; docs/benchmarks.md, "Expert streaming").
DEFAULT_MIN_SEGMENT_BYTES = 0
DIRECT_IO_ALIGNMENT = 4096


class ExpertFileError(RuntimeError):
    """A layer file is missing, truncated or unreadable (names file and expert)."""


class DirectIOUnsupported(OSError):
    """O_DIRECT refused by the filesystem (tmpfs, some overlays)."""


@dataclass(frozen=True)
class RecordRead:
    """Read expert `expert` of `layer` and scatter it: `targets` are (offset in record, uint8 buffer)."""

    layer: int
    expert: int
    targets: Sequence[tuple[int, np.ndarray]]


def check_layer_file(split_dir: Path, layer: MoeLayer) -> Path:
    """The layer file's path, after checking it exists and has the manifest's size."""
    path = Path(split_dir) / layer.file
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ExpertFileError(f"{path}: missing (layer {layer.layer})") from None
    if size != layer.file_size:
        raise ExpertFileError(
            f"{path}: {size} bytes, manifest says {layer.file_size} "
            f"({layer.num_experts} experts x {layer.record_size}); the file is truncated or from another split"
        )
    return path


def open_record_file(path: Path, mode: str) -> int:
    """Open a layer file for `mode` reads; a filesystem without direct I/O is a clear error."""
    if mode not in IO_MODES:
        raise ValueError(f"io mode {mode!r}: choose one of {', '.join(IO_MODES)}")
    flags = os.O_RDONLY
    if mode == "direct" and hasattr(os, "O_DIRECT"):
        flags |= os.O_DIRECT
    try:
        fd = os.open(path, flags)
    except OSError as error:
        if mode == "direct" and error.errno == errno.EINVAL:
            raise DirectIOUnsupported(f"{path}: the filesystem does not support direct I/O") from None
        if mode == "direct":
            raise ExpertFileError(
                f"{path}: cannot open for direct I/O ({error}); use --io buffered"
            ) from None
        raise ExpertFileError(f"{path}: cannot open ({error})") from None
    if mode == "direct" and sys.platform == "darwin":
        import fcntl

        fcntl.fcntl(fd, fcntl.F_NOCACHE, 1)  # macOS has no O_DIRECT; this bypasses the unified buffer cache
    return fd


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 buffer (anonymous mmap), as O_DIRECT requires."""
    return np.frombuffer(mmap.mmap(-1, max(nbytes, mmap.PAGESIZE)), dtype=np.uint8)[:nbytes]


def drop_page_cache(path: Path) -> None:
    """Ask the kernel to forget the file's cached pages (no root needed; Linux only)."""
    if hasattr(os, "posix_fadvise"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages (a freshly written split) cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@dataclass(frozen=True)
class _Segment:
    """Bytes [start, stop) of one record read; start is page-aligned within the record."""

    read: RecordRead
    start: int
    stop: int


class RecordReader:
    """Parallel whole-record reads from a split's layer files.

    Thread-safe for concurrent `read_many` calls only in the sense that each read
    writes its own targets; callers must not give two reads the same target.
    `min_segment_bytes` = 0 reads every record in one piece.
    """

    def __init__(
        self,
        split_dir: Path,
        layers: Sequence[MoeLayer],
        mode: str = "buffered",
        threads: int = DEFAULT_IO_THREADS,
        min_segment_bytes: int = DEFAULT_MIN_SEGMENT_BYTES,
    ):
        if threads < 1:
            raise ValueError("io threads must be at least 1")
        if min_segment_bytes < 0:
            raise ValueError("the minimum segment size cannot be negative")
        self.mode = mode
        self.threads = threads
        self.min_segment_bytes = min_segment_bytes
        self._layers = {layer.layer: layer for layer in layers}
        self._paths: dict[int, Path] = {}
        self._fds: dict[int, int] = {}
        try:
            for layer in layers:
                self._paths[layer.layer] = check_layer_file(split_dir, layer)
            try:
                self._open_all()
            except DirectIOUnsupported as error:
                # The split's files share a filesystem: read them all through the page cache.
                log.warning("direct_io_unsupported", error=str(error), fallback="buffered")
                self.close_files()
                self.mode = "buffered"
                self._open_all()
        except BaseException:
            self.close()
            raise
        self._record_size = max((layer.record_size for layer in layers), default=0)
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="expert-io")

    def _open_all(self) -> None:
        for layer, path in self._paths.items():
            self._fds[layer] = open_record_file(path, self.mode)

    def close_files(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def path(self, layer: int) -> Path:
        return self._paths[layer]

    def read_many(self, reads: Sequence[RecordRead]) -> tuple[int, float, list[tuple[RecordRead, str]]]:
        """Issue all reads at once; wait for all. Returns (bytes read, seconds, failures).

        A failure is (the read, message naming file and expert), one per failed record
        however many of its segments failed; its targets hold undefined bytes and must not be used.
        """
        if not reads:
            return 0, 0.0, []
        start = time.perf_counter()
        segments = self.segments(reads)
        # The caller reads the first segment itself: waking a pool thread costs more than a
        # segment's own latency on a busy CPU, and the caller would only wait otherwise.
        futures = [self._pool.submit(self._read_segment, segment) for segment in segments[1:]]
        outcomes: list[int | BaseException] = []
        try:
            outcomes.append(self._read_segment(segments[0]))
        except Exception as error:  # noqa: BLE001 - reported like the pool's failures, after all finished
            outcomes.append(error)
        wait(futures)
        seconds = time.perf_counter() - start
        outcomes += [future.exception() or future.result() for future in futures]
        total, failed = 0, {}
        for segment, outcome in zip(segments, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                failed.setdefault(id(segment.read), (segment.read, str(outcome)))
            else:
                total += outcome
        return total, seconds, list(failed.values())

    def segments(self, reads: Sequence[RecordRead]) -> list[_Segment]:
        """Cut each record into page-aligned pieces so that about `threads` reads are in flight."""
        per_record = max(1, -(-self.threads // len(reads)))
        out = []
        for read in reads:
            extent = _extent(read.targets, self.mode)
            pieces = 1
            if self.min_segment_bytes:
                pieces = min(per_record, max(1, extent // self.min_segment_bytes))
            size = -(-extent // pieces)
            size = -(-size // DIRECT_IO_ALIGNMENT) * DIRECT_IO_ALIGNMENT
            out += [_Segment(read, lo, min(lo + size, extent)) for lo in range(0, extent, size)]
        return out

    def _read_segment(self, segment: _Segment) -> int:
        read = segment.read
        layer = self._layers[read.layer]
        offset = read.expert * layer.record_size + segment.start
        fd = self._fds[read.layer]
        expected = segment.stop - segment.start
        try:
            iovecs = _scatter_iovecs(read.targets, segment.start, segment.stop, self._gap_scratch())
            if self.mode == "buffered" or _direct_io_aligned(iovecs, offset):
                got = os.preadv(fd, iovecs, offset)  # straight into the targets
            else:
                # Whole pages into staging (the record's padding keeps this inside the file).
                expected = -(-expected // DIRECT_IO_ALIGNMENT) * DIRECT_IO_ALIGNMENT
                staging = self._staging()
                got = os.preadv(fd, [staging[:expected]], offset)
                if got == expected:
                    _copy_out(staging, read.targets, segment.start, segment.stop)
        except OSError as error:
            raise ExpertFileError(
                f"{self._paths[read.layer]}: reading expert {read.expert} of layer {read.layer} "
                f"at offset {offset} failed: {error}"
            ) from None
        if got != expected:
            raise ExpertFileError(
                f"{self._paths[read.layer]}: short read of expert {read.expert} of layer {read.layer} "
                f"({got} of {expected} bytes at offset {offset}); the file was truncated"
            )
        return segment.stop - segment.start

    def _staging(self) -> np.ndarray:
        buffer = getattr(self._local, "staging", None)
        if buffer is None:
            buffer = self._local.staging = aligned_buffer(self._record_size)
        return buffer

    def _gap_scratch(self) -> np.ndarray:
        buffer = getattr(self._local, "gap", None)
        if buffer is None:
            buffer = self._local.gap = aligned_buffer(self._record_size)
        return buffer

    def close(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
        self.close_files()

    def __enter__(self) -> RecordReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _extent(targets: Sequence[tuple[int, np.ndarray]], mode: str) -> int:
    """Bytes of the record to read: up to the end of the last target (whole pages for direct I/O)."""
    end = max((start + target.nbytes for start, target in targets), default=0)
    if mode == "direct":
        end = -(-end // DIRECT_IO_ALIGNMENT) * DIRECT_IO_ALIGNMENT
    return end


def _direct_io_aligned(iovecs: list, offset: int) -> bool:
    """Whether O_DIRECT accepts these buffers as they are (addresses and lengths block-aligned)."""
    if offset % DIRECT_IO_ALIGNMENT:
        return False
    return all(
        v.__array_interface__["data"][0] % DIRECT_IO_ALIGNMENT == 0 and v.nbytes % DIRECT_IO_ALIGNMENT == 0
        for v in iovecs
    )


def _scatter_iovecs(targets: Sequence[tuple[int, np.ndarray]], lo: int, hi: int, scratch: np.ndarray) -> list:
    """iovecs that land bytes [lo, hi) of the record in the targets; bytes no target wants go to scratch."""
    iovecs, position = [], lo
    for start, target in sorted(targets, key=lambda item: item[0]):
        first, last = max(start, lo), min(start + target.nbytes, hi)
        if first >= last:
            continue
        if first > position:
            iovecs.append(scratch[: first - position])
        iovecs.append(target[first - start : last - start])
        position = last
    if hi > position:
        iovecs.append(scratch[: hi - position])
    return iovecs


def _copy_out(staging: np.ndarray, targets: Sequence[tuple[int, np.ndarray]], lo: int, hi: int) -> None:
    """Copy the parts of the targets that fall in [lo, hi) of the record out of staging (holding lo..)."""
    for start, target in targets:
        first, last = max(start, lo), min(start + target.nbytes, hi)
        if first < last:
            np.copyto(target[first - start : last - start], staging[first - lo : last - lo])
