"""Host bytes into MLX arrays without a page migration per call, on MLX's CUDA backend.

MLX's CUDA allocator hands out managed memory. An array made from host bytes (`mx.array(numpy)`)
takes a recycled buffer whose pages the GPU touched last: the host's copy into it migrates them
to the CPU, and the first kernel that reads it migrates them back. For the few KB a layer call
carries, those two faults cost more than the expert math.

`HostStaging` instead keeps a few buffers per size that the host writes in place. Each is
advised to live in host memory and to be mapped by the GPU, so neither side faults, and each
upload is one device copy out of it (`upload`). A buffer is written again only after that
copy has run (its result is evaluated first), whatever the graphs that read the copy do later.
Apple GPUs and CPUs share memory outright: there the plain `mx.array` path serves.
`MOE_MESH_HOST_STAGING=off` takes the plain path everywhere; `on` stages everywhere (advice only
on CUDA), which lets the tests run this path on a CPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading

import mlx.core as mx
import numpy as np
import structlog

log = structlog.get_logger()

_MIN_BYTES = 4096
_BUFFERS_PER_SIZE = 2
# Uploads larger than this take the plain path: there the migration is small beside the compute
# they feed (a prefill chunk), and every thread that uploads keeps its own buffers.
_MAX_STAGED_BYTES = 4 << 20
# Below this a read faulting its few pages over beats the copy engine's fixed cost.
_MIN_COPY_ENGINE_BYTES = 16384

# CUmem_advise values and CUmemLocationType, from cuda.h
_ADVISE_PREFERRED_LOCATION = 3
_ADVISE_ACCESSED_BY = 5
_LOCATION_DEVICE, _LOCATION_HOST = 1, 2
_ERROR_INVALID_CONTEXT = 201


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemoryAdvisor:
    """cuMemAdvise through the driver library MLX already loaded."""

    def __init__(self, library_path: str):
        self._cuda = ctypes.CDLL(library_path)
        self._advise = self._cuda.cuMemAdvise_v2
        self._advise.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, _MemLocation]
        self._advise.restype = ctypes.c_int
        self._memcpy = self._cuda.cuMemcpyDtoH_v2
        self._memcpy.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
        self._memcpy.restype = ctypes.c_int
        self._cuda.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        self._cuda.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]

    def copy_to_host(self, destination: int, source: int, nbytes: int) -> bool:
        """cuMemcpyDtoH: the copy engine moves the bytes, where a read through the pointer would
        fault the pages over one by one. False when the driver refuses (no context here)."""
        status = self._memcpy(destination, source, nbytes)
        if status == _ERROR_INVALID_CONTEXT and self._make_context_current():
            status = self._memcpy(destination, source, nbytes)
        return status == 0

    def _make_context_current(self) -> bool:
        context = ctypes.c_void_p()
        if self._cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), 0) != 0:
            return False
        return self._cuda.cuCtxSetCurrent(context) == 0

    def advise(
        self, address: int, nbytes: int, host_resident: bool = True, device_mapped: bool = True
    ) -> None:
        """`host_resident`: the pages prefer host memory; `device_mapped`: the GPU maps them and
        reads them in place rather than migrating them. Both: what the staging buffers get."""
        for advice, location, wanted in (
            (_ADVISE_PREFERRED_LOCATION, _MemLocation(_LOCATION_HOST, 0), host_resident),
            (_ADVISE_ACCESSED_BY, _MemLocation(_LOCATION_DEVICE, 0), device_mapped),
        ):
            if not wanted:
                continue
            status = self._advise(address, nbytes, advice, location)
            if status != 0:
                raise OSError(f"cuMemAdvise({advice}) returned CUDA error {status}")

    @staticmethod
    def find() -> MemoryAdvisor | None:
        """The advisor for this process's CUDA driver, once MLX has loaded it; None elsewhere."""
        if not mx.cuda.is_available():
            return None
        mx.eval(mx.zeros(1))  # MLX loads the driver with its first GPU work
        try:
            with open("/proc/self/maps") as maps:
                paths = {line.split()[-1] for line in maps if "libcuda.so" in line}
        except OSError:
            return None
        for path in sorted(paths):
            try:
                return MemoryAdvisor(path)
            except (OSError, AttributeError):
                continue
        return None


class _Buffer:
    def __init__(self, nbytes: int, advisor: MemoryAdvisor | None):
        self.array = mx.zeros((nbytes,), dtype=mx.uint8)
        mx.eval(self.array)
        self.host = np.frombuffer(memoryview(self.array), dtype=np.uint8)
        if advisor is not None:
            advisor.advise(self.host.ctypes.data, nbytes)
        self.last_copy: mx.array | None = None


class HostStaging:
    """Per thread: buffers by size (powers of two), used in turn."""

    def __init__(self, advisor: MemoryAdvisor | None):
        self._advisor = advisor
        self._local = threading.local()

    def upload(self, *parts: np.ndarray) -> mx.array:
        """A uint8 MLX array holding the parts' bytes one after another, computed on the device
        (lazily). The parts are written straight into the buffer: no packing copy first."""
        raws = [np.ascontiguousarray(part).reshape(-1).view(np.uint8) for part in parts]
        nbytes = sum(raw.nbytes for raw in raws)
        if nbytes == 0 or nbytes > _MAX_STAGED_BYTES:
            return mx.array(np.concatenate(raws) if len(raws) > 1 else raws[0])
        buffer = self._next_buffer(max(_MIN_BYTES, 1 << (nbytes - 1).bit_length()))
        if buffer.last_copy is not None:
            mx.eval(buffer.last_copy)  # its copy out has run (a no-op once a consumer evaluated it)
        start = 0
        for raw in raws:
            buffer.host[start : start + raw.nbytes] = raw
            start += raw.nbytes
        staged = buffer.array[:nbytes]
        buffer.last_copy = mx.bitwise_or(staged, staged)  # a device copy: the graph never reads the buffer
        return buffer.last_copy

    def download(self, array: mx.array) -> np.ndarray:
        """An evaluated array's bytes on the host (bf16 arrays in wire form: see tensor_codec).
        On CUDA a new host array filled by the copy engine; elsewhere a view, as np.asarray."""
        view = np.asarray(array)  # a view over the array's memory: no page is read yet
        if self._advisor is None or not view.flags.c_contiguous or view.nbytes < _MIN_COPY_ENGINE_BYTES:
            return view
        host = np.empty_like(view)
        if not self._advisor.copy_to_host(host.ctypes.data, view.ctypes.data, view.nbytes):
            return view
        return host

    def _next_buffer(self, size: int) -> _Buffer:
        rings = getattr(self._local, "rings", None)
        if rings is None:
            rings = self._local.rings = {}
        ring = rings.get(size)
        if ring is None:
            ring = rings[size] = [[_Buffer(size, self._advisor) for _ in range(_BUFFERS_PER_SIZE)], 0]
        buffers, turn = ring
        ring[1] = (turn + 1) % len(buffers)
        return buffers[turn]


class _ProcessChoice:
    """Whether this process stages, decided at the first upload."""

    def __init__(self):
        self.decided = False
        self.staging: HostStaging | None = None
        self.lock = threading.Lock()


_PROCESS = _ProcessChoice()


def staging() -> HostStaging | None:
    """This process's staging on MLX's CUDA backend; None where plain arrays serve (or when the
    driver refuses the advice)."""
    if _PROCESS.decided:
        return _PROCESS.staging
    with _PROCESS.lock:
        if not _PROCESS.decided:
            mode = os.environ.get("MOE_MESH_HOST_STAGING", "auto").lower()
            advisor = MemoryAdvisor.find() if mode != "off" else None
            if advisor is not None or mode == "on":
                try:
                    candidate = HostStaging(advisor)
                    candidate.upload(np.zeros(16, dtype=np.uint8))
                    _PROCESS.staging = candidate
                except OSError as error:
                    log.warning("host_staging_off", reason=str(error))
            _PROCESS.decided = True
    return _PROCESS.staging


@contextlib.contextmanager
def plain_arrays():
    """Within: every upload takes the plain `mx.array` path (for A/B measurements)."""
    saved = staging()
    _PROCESS.staging = None
    try:
        yield
    finally:
        _PROCESS.staging = saved
