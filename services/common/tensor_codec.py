"""Tensor <-> wire bytes, with the checks every decoder must make.

Arrays leave MLX through the buffer protocol in their own dtype (bf16 stays bf16:
it travels as its uint16 bit pattern) and enter MLX from the received bytes with one
copy. Nothing here goes through float32 or pickle.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from services.common import host_staging
from services.proto.moemesh.v1 import tensor_pb2

DType = tensor_pb2.DType

# wire dtype -> (mlx dtype, numpy dtype used to carry its bytes)
_WIRE = {
    DType.FLOAT32: (mx.float32, np.dtype("<f4")),
    DType.FLOAT16: (mx.float16, np.dtype("<f2")),
    DType.BFLOAT16: (mx.bfloat16, np.dtype("<u2")),
    DType.INT32: (mx.int32, np.dtype("<i4")),
    DType.INT64: (mx.int64, np.dtype("<i8")),
    DType.UINT32: (mx.uint32, np.dtype("<u4")),
    DType.UINT8: (mx.uint8, np.dtype("u1")),
    DType.INT8: (mx.int8, np.dtype("i1")),
    DType.UINT16: (mx.uint16, np.dtype("<u2")),
    DType.INT16: (mx.int16, np.dtype("<i2")),
    DType.BOOL: (mx.bool_, np.dtype("?")),
}
_FROM_MLX = {mlx_dtype: wire for wire, (mlx_dtype, _) in _WIRE.items()}
MLX_DTYPE_BY_NAME = {str(m).removeprefix("mlx.core."): m for m, _ in _WIRE.values()}


class TensorDecodeError(ValueError):
    """A received Tensor is malformed. `field` names the message field at fault."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def wire_form(array: mx.array) -> mx.array:
    """The array whose bytes go on the wire: bf16 as its uint16 bit pattern, anything else as is.

    Hot paths evaluate this (not the array itself) in their one synchronisation, so reading the
    bytes afterwards costs no second sync.
    """
    return array.view(mx.uint16) if array.dtype == mx.bfloat16 else array


def numpy_view(array: mx.array) -> np.ndarray:
    """A numpy view of an MLX array's bytes (no copy for contiguous arrays; on MLX's CUDA backend a
    copy made by the copy engine: see host_staging); bf16 shows as uint16.

    The wire form is evaluated here, explicitly (a no-op when it already is): reading a lazy
    array through the buffer protocol does not wait for the GPU on MLX's CUDA backend, and
    silently yields stale bytes there.
    """
    wire = wire_form(array)
    mx.eval(wire)
    stage = host_staging.staging()
    return np.asarray(wire) if stage is None else stage.download(wire)


def nan_of(dtype: mx.Dtype) -> np.generic:
    """NaN of a float MLX dtype in its wire form (bf16: the uint16 bit pattern)."""
    wire = _WIRE[_FROM_MLX[dtype]][1]
    return wire.type(0x7FC0) if dtype == mx.bfloat16 else wire.type("nan")


def has_nan(host: np.ndarray, dtype: mx.Dtype) -> bool:
    """Whether a host copy of an array of MLX dtype `dtype` (bf16 as its uint16 bits) holds NaN."""
    if dtype == mx.bfloat16:
        return bool(((host & 0x7FFF) > 0x7F80).any())
    if host.dtype.kind != "f":
        return False
    return bool(np.isnan(host).any())


def encode(array: mx.array, out: tensor_pb2.Tensor | None = None) -> tensor_pb2.Tensor:
    """Fill `out` (or a new Tensor) from an evaluated MLX array."""
    wire = _FROM_MLX.get(array.dtype)
    if wire is None:
        raise TypeError(f"dtype {array.dtype} cannot go on the wire")
    out = out if out is not None else tensor_pb2.Tensor()
    out.dtype = wire
    out.shape[:] = array.shape
    out.data = numpy_view(array).tobytes()
    return out


def encode_numpy(
    array: np.ndarray, wire_dtype: int, out: tensor_pb2.Tensor | None = None
) -> tensor_pb2.Tensor:
    out = out if out is not None else tensor_pb2.Tensor()
    out.dtype = wire_dtype
    out.shape[:] = array.shape
    out.data = np.ascontiguousarray(array).tobytes()
    return out


def check(
    tensor: tensor_pb2.Tensor, field: str, max_bytes: int, ndim: int | None = None
) -> tuple[mx.Dtype, np.dtype]:
    """Validate a Tensor's header against its payload; raise TensorDecodeError naming `field`."""
    spec = _WIRE.get(tensor.dtype)
    if spec is None:
        raise TensorDecodeError(field, f"unknown or unset dtype {tensor.dtype}")
    shape = tuple(tensor.shape)
    if ndim is not None and len(shape) != ndim:
        raise TensorDecodeError(field, f"expected {ndim} dimensions, got shape {list(shape)}")
    if any(d < 0 for d in shape):
        raise TensorDecodeError(field, f"negative dimension in shape {list(shape)}")
    if any(d > max_bytes for d in shape):  # an empty tensor ([0, 2**62]) is small, but no array
        raise TensorDecodeError(field, f"a dimension of shape {list(shape)} exceeds the cap of {max_bytes}")
    itemsize = spec[1].itemsize
    expected = math.prod(shape) * itemsize
    if expected > max_bytes:
        raise TensorDecodeError(field, f"{expected} bytes exceeds the cap of {max_bytes}")
    if expected != len(tensor.data):
        raise TensorDecodeError(
            field,
            f"shape {list(shape)} x {itemsize} bytes = {expected} bytes, but data holds {len(tensor.data)}",
        )
    return spec


def decode_numpy(
    tensor: tensor_pb2.Tensor, field: str, max_bytes: int, ndim: int | None = None
) -> np.ndarray:
    """A read-only numpy view over the Tensor's bytes (bf16 appears as uint16)."""
    _, np_dtype = check(tensor, field, max_bytes, ndim)
    return np.frombuffer(tensor.data, dtype=np_dtype).reshape(tuple(tensor.shape))


def decode(tensor: tensor_pb2.Tensor, field: str, max_bytes: int, ndim: int | None = None) -> mx.array:
    """An MLX array built once from the Tensor's bytes."""
    mlx_dtype, np_dtype = check(tensor, field, max_bytes, ndim)
    return _as_mlx(np.frombuffer(tensor.data, dtype=np_dtype).reshape(tuple(tensor.shape)), mlx_dtype)


def to_mlx(host: np.ndarray) -> mx.array:
    """An MLX array of hidden states held on the host in their wire form (bf16 as uint16)."""
    return _as_mlx(host, hidden_dtype_of(host))


def to_mlx_with_ids(host: np.ndarray, ids: np.ndarray) -> tuple[mx.array, mx.array]:
    """`to_mlx(host)` and int32 `ids` as MLX arrays made from one host buffer. On a discrete GPU
    each array made from host memory pays an allocation and a page migration of its own, so a
    call's two inputs travel as one (ids first: 4-byte aligned, whatever the states' dtype)."""
    ids = np.ascontiguousarray(ids, dtype=np.int32)
    stage = host_staging.staging()
    if stage is not None:
        device = stage.upload(ids, host)
    else:
        raws = (ids.reshape(-1).view(np.uint8), np.ascontiguousarray(host).reshape(-1).view(np.uint8))
        device = mx.array(np.concatenate(raws))
    dtype = hidden_dtype_of(host)
    device_ids = device[: ids.nbytes].view(mx.int32).reshape(ids.shape)
    device_hidden = device[ids.nbytes :].view(dtype).reshape(host.shape)
    return device_hidden, device_ids


def _as_mlx(host: np.ndarray, dtype: mx.Dtype) -> mx.array:
    stage = host_staging.staging()
    if stage is not None and host.size:
        return stage.upload(host).view(dtype).reshape(host.shape)
    array = mx.array(host)  # bf16 arrives as its uint16 bits
    return array.view(mx.bfloat16) if dtype == mx.bfloat16 else array


# hidden states on the host, in their wire form -> their MLX dtype (bf16 travels as its uint16 bits)
_HIDDEN_BY_HOST = {np.dtype("<f4"): mx.float32, np.dtype("<f2"): mx.float16, np.dtype("<u2"): mx.bfloat16}


def hidden_dtype_of(host: np.ndarray) -> mx.Dtype:
    """The MLX dtype of a host copy of hidden states in their wire form (see `numpy_view`)."""
    dtype = _HIDDEN_BY_HOST.get(host.dtype)
    if dtype is None:
        raise TypeError(f"hidden states of numpy dtype {host.dtype} are not float32, float16 or bfloat16")
    return dtype


_WIRE_NAMES = dict(zip(tensor_pb2.DType.values(), tensor_pb2.DType.keys(), strict=True))


def wire_dtype_label(wire_dtype: int) -> str:
    """The DType's name, or the number a newer (or hostile) peer sent that this version has no name for."""
    return _WIRE_NAMES.get(wire_dtype, f"dtype {wire_dtype}")


def wire_dtype_of(array_dtype: mx.Dtype) -> int:
    return _FROM_MLX[array_dtype]
