# Generated from protos/ by `python -m services.proto.regenerate`. DO NOT EDIT.
from services.proto.moemesh.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ("join_data_plane", "include_metrics")
    JOIN_DATA_PLANE_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_METRICS_FIELD_NUMBER: _ClassVar[int]
    join_data_plane: bool
    include_metrics: bool
    def __init__(self, join_data_plane: _Optional[bool] = ..., include_metrics: _Optional[bool] = ...) -> None: ...

class LayerExperts(_message.Message):
    __slots__ = ("layer", "experts", "resident")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    layer: int
    experts: _containers.RepeatedScalarFieldContainer[int]
    resident: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, layer: _Optional[int] = ..., experts: _Optional[_Iterable[int]] = ..., resident: _Optional[_Iterable[bool]] = ...) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("model_fingerprint", "layers", "memory_budget_bytes", "resident_bytes", "worker_id", "num_experts", "hidden_dtype", "frames_path", "cache_hits", "cache_misses", "cache_evictions", "bytes_read", "read_seconds", "read_gbps", "read_failures", "cache_slots", "io_mode", "cache_policy", "data_plane_rank", "metrics_text")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_DTYPE_FIELD_NUMBER: _ClassVar[int]
    FRAMES_PATH_FIELD_NUMBER: _ClassVar[int]
    CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    CACHE_MISSES_FIELD_NUMBER: _ClassVar[int]
    CACHE_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    READ_SECONDS_FIELD_NUMBER: _ClassVar[int]
    READ_GBPS_FIELD_NUMBER: _ClassVar[int]
    READ_FAILURES_FIELD_NUMBER: _ClassVar[int]
    CACHE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    IO_MODE_FIELD_NUMBER: _ClassVar[int]
    CACHE_POLICY_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_RANK_FIELD_NUMBER: _ClassVar[int]
    METRICS_TEXT_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    layers: _containers.RepeatedCompositeFieldContainer[LayerExperts]
    memory_budget_bytes: int
    resident_bytes: int
    worker_id: str
    num_experts: int
    hidden_dtype: str
    frames_path: str
    cache_hits: int
    cache_misses: int
    cache_evictions: int
    bytes_read: int
    read_seconds: float
    read_gbps: float
    read_failures: int
    cache_slots: int
    io_mode: str
    cache_policy: str
    data_plane_rank: int
    metrics_text: str
    def __init__(self, model_fingerprint: _Optional[str] = ..., layers: _Optional[_Iterable[_Union[LayerExperts, _Mapping]]] = ..., memory_budget_bytes: _Optional[int] = ..., resident_bytes: _Optional[int] = ..., worker_id: _Optional[str] = ..., num_experts: _Optional[int] = ..., hidden_dtype: _Optional[str] = ..., frames_path: _Optional[str] = ..., cache_hits: _Optional[int] = ..., cache_misses: _Optional[int] = ..., cache_evictions: _Optional[int] = ..., bytes_read: _Optional[int] = ..., read_seconds: _Optional[float] = ..., read_gbps: _Optional[float] = ..., read_failures: _Optional[int] = ..., cache_slots: _Optional[int] = ..., io_mode: _Optional[str] = ..., cache_policy: _Optional[str] = ..., data_plane_rank: _Optional[int] = ..., metrics_text: _Optional[str] = ...) -> None: ...

class ExpertCall(_message.Message):
    __slots__ = ("call_id", "layer", "hidden", "expert_ids", "request_ids")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    EXPERT_IDS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    layer: int
    hidden: _tensor_pb2.Tensor
    expert_ids: _tensor_pb2.Tensor
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, call_id: _Optional[int] = ..., layer: _Optional[int] = ..., hidden: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., expert_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class CallStats(_message.Message):
    __slots__ = ("decode_us", "compute_us", "encode_us", "pairs", "started_ns", "finished_ns")
    DECODE_US_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    ENCODE_US_FIELD_NUMBER: _ClassVar[int]
    PAIRS_FIELD_NUMBER: _ClassVar[int]
    STARTED_NS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_NS_FIELD_NUMBER: _ClassVar[int]
    decode_us: int
    compute_us: int
    encode_us: int
    pairs: int
    started_ns: int
    finished_ns: int
    def __init__(self, decode_us: _Optional[int] = ..., compute_us: _Optional[int] = ..., encode_us: _Optional[int] = ..., pairs: _Optional[int] = ..., started_ns: _Optional[int] = ..., finished_ns: _Optional[int] = ...) -> None: ...

class ExpertResult(_message.Message):
    __slots__ = ("call_id", "output", "stats", "error")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    output: _tensor_pb2.Tensor
    stats: CallStats
    error: _tensor_pb2.CallError
    def __init__(self, call_id: _Optional[int] = ..., output: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., stats: _Optional[_Union[CallStats, _Mapping]] = ..., error: _Optional[_Union[_tensor_pb2.CallError, _Mapping]] = ...) -> None: ...
