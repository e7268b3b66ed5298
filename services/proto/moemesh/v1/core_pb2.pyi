# Generated from protos/ by `python -m services.proto.regenerate`. DO NOT EDIT.
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    STOP: _ClassVar[FinishReason]
    LENGTH: _ClassVar[FinishReason]
    TOOL_CALLS: _ClassVar[FinishReason]
    CANCELLED: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
STOP: FinishReason
LENGTH: FinishReason
TOOL_CALLS: FinishReason
CANCELLED: FinishReason

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments", "index")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    index: int
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "name", "tool_call_id", "tool_calls", "parts")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    name: str
    tool_call_id: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    parts: _containers.RepeatedCompositeFieldContainer[ContentPart]
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., name: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., parts: _Optional[_Iterable[_Union[ContentPart, _Mapping]]] = ...) -> None: ...

class ContentPart(_message.Message):
    __slots__ = ("text", "image")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    text: str
    image: ImageInput
    def __init__(self, text: _Optional[str] = ..., image: _Optional[_Union[ImageInput, _Mapping]] = ...) -> None: ...

class ImageInput(_message.Message):
    __slots__ = ("data", "media_type")
    DATA_FIELD_NUMBER: _ClassVar[int]
    MEDIA_TYPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    media_type: str
    def __init__(self, data: _Optional[bytes] = ..., media_type: _Optional[str] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters_json: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters_json: _Optional[str] = ...) -> None: ...

class ToolChoice(_message.Message):
    __slots__ = ("mode", "function_name")
    class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        AUTO: _ClassVar[ToolChoice.Mode]
        NONE: _ClassVar[ToolChoice.Mode]
        REQUIRED: _ClassVar[ToolChoice.Mode]
        NAMED: _ClassVar[ToolChoice.Mode]
    AUTO: ToolChoice.Mode
    NONE: ToolChoice.Mode
    REQUIRED: ToolChoice.Mode
    NAMED: ToolChoice.Mode
    MODE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_NAME_FIELD_NUMBER: _ClassVar[int]
    mode: ToolChoice.Mode
    function_name: str
    def __init__(self, mode: _Optional[_Union[ToolChoice.Mode, str]] = ..., function_name: _Optional[str] = ...) -> None: ...

class ChatInput(_message.Message):
    __slots__ = ("messages", "tools", "add_generation_prompt", "template_kwargs_json", "tool_choice", "continue_final_message")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    add_generation_prompt: bool
    template_kwargs_json: str
    tool_choice: ToolChoice
    continue_final_message: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ..., template_kwargs_json: _Optional[str] = ..., tool_choice: _Optional[_Union[ToolChoice, _Mapping]] = ..., continue_final_message: _Optional[bool] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class StoppingCriteria(_message.Message):
    __slots__ = ("max_tokens", "stop", "stop_token_ids", "ignore_eos")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    def __init__(self, max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class ResponseFormat(_message.Message):
    __slots__ = ("type", "schema_json", "name", "strict")
    class Type(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        TEXT: _ClassVar[ResponseFormat.Type]
        JSON_OBJECT: _ClassVar[ResponseFormat.Type]
        JSON_SCHEMA: _ClassVar[ResponseFormat.Type]
    TEXT: ResponseFormat.Type
    JSON_OBJECT: ResponseFormat.Type
    JSON_SCHEMA: ResponseFormat.Type
    TYPE_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_JSON_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    type: ResponseFormat.Type
    schema_json: str
    name: str
    strict: bool
    def __init__(self, type: _Optional[_Union[ResponseFormat.Type, str]] = ..., schema_json: _Optional[str] = ..., name: _Optional[str] = ..., strict: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "chat", "prompt", "token_ids", "sampling", "stopping", "top_logprobs", "logprobs", "response_format", "echo", "prompt_logprobs", "kv_cache", "speculative")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    ECHO_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    chat: ChatInput
    prompt: str
    token_ids: TokenIds
    sampling: SamplingParams
    stopping: StoppingCriteria
    top_logprobs: int
    logprobs: bool
    response_format: ResponseFormat
    echo: bool
    prompt_logprobs: bool
    kv_cache: str
    speculative: bool
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., chat: _Optional[_Union[ChatInput, _Mapping]] = ..., prompt: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stopping: _Optional[_Union[StoppingCriteria, _Mapping]] = ..., top_logprobs: _Optional[int] = ..., logprobs: _Optional[bool] = ..., response_format: _Optional[_Union[ResponseFormat, _Mapping]] = ..., echo: _Optional[bool] = ..., prompt_logprobs: _Optional[bool] = ..., kv_cache: _Optional[str] = ..., speculative: _Optional[bool] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "token_bytes")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    token_bytes: bytes
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., token_bytes: _Optional[bytes] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "top", "token_bytes")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    token_bytes: bytes
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., token_bytes: _Optional[bytes] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class RequestTimings(_message.Message):
    __slots__ = ("queue_seconds", "prefill_seconds")
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    queue_seconds: float
    prefill_seconds: float
    def __init__(self, queue_seconds: _Optional[float] = ..., prefill_seconds: _Optional[float] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("text", "token_ids", "logprobs", "tool_calls", "finish_reason", "usage", "request_id", "reasoning", "timings", "matched_stop", "prompt_logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    finish_reason: FinishReason
    usage: Usage
    request_id: str
    reasoning: str
    timings: RequestTimings
    matched_stop: str
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., request_id: _Optional[str] = ..., reasoning: _Optional[str] = ..., timings: _Optional[_Union[RequestTimings, _Mapping]] = ..., matched_stop: _Optional[str] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("id", "model_type", "context_length", "fingerprint", "created", "images_refused")
    ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    IMAGES_REFUSED_FIELD_NUMBER: _ClassVar[int]
    id: str
    model_type: str
    context_length: int
    fingerprint: str
    created: int
    images_refused: str
    def __init__(self, id: _Optional[str] = ..., model_type: _Optional[str] = ..., context_length: _Optional[int] = ..., fingerprint: _Optional[str] = ..., created: _Optional[int] = ..., images_refused: _Optional[str] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class CountTokensRequest(_message.Message):
    __slots__ = ("chat", "prompt", "model", "return_ids")
    CHAT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RETURN_IDS_FIELD_NUMBER: _ClassVar[int]
    chat: ChatInput
    prompt: str
    model: str
    return_ids: bool
    def __init__(self, chat: _Optional[_Union[ChatInput, _Mapping]] = ..., prompt: _Optional[str] = ..., model: _Optional[str] = ..., return_ids: _Optional[bool] = ...) -> None: ...

class CountTokensResponse(_message.Message):
    __slots__ = ("count", "ids")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    count: int
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, count: _Optional[int] = ..., ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("ids", "model")
    IDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    model: str
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., model: _Optional[str] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("reset_layer_calls",)
    RESET_LAYER_CALLS_FIELD_NUMBER: _ClassVar[int]
    reset_layer_calls: bool
    def __init__(self, reset_layer_calls: _Optional[bool] = ...) -> None: ...

class LayerCallStats(_message.Message):
    __slots__ = ("calls", "total_p50_us", "total_p99_us", "worker_p50_us", "worker_p99_us", "compute_p50_us", "compute_p99_us", "transport_p50_us", "transport_p99_us", "part_p50_us", "part_p99_us")
    class PartP50UsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class PartP99UsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    CALLS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_P50_US_FIELD_NUMBER: _ClassVar[int]
    TOTAL_P99_US_FIELD_NUMBER: _ClassVar[int]
    WORKER_P50_US_FIELD_NUMBER: _ClassVar[int]
    WORKER_P99_US_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_P50_US_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_P99_US_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_P50_US_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_P99_US_FIELD_NUMBER: _ClassVar[int]
    PART_P50_US_FIELD_NUMBER: _ClassVar[int]
    PART_P99_US_FIELD_NUMBER: _ClassVar[int]
    calls: int
    total_p50_us: float
    total_p99_us: float
    worker_p50_us: float
    worker_p99_us: float
    compute_p50_us: float
    compute_p99_us: float
    transport_p50_us: float
    transport_p99_us: float
    part_p50_us: _containers.ScalarMap[str, float]
    part_p99_us: _containers.ScalarMap[str, float]
    def __init__(self, calls: _Optional[int] = ..., total_p50_us: _Optional[float] = ..., total_p99_us: _Optional[float] = ..., worker_p50_us: _Optional[float] = ..., worker_p99_us: _Optional[float] = ..., compute_p50_us: _Optional[float] = ..., compute_p99_us: _Optional[float] = ..., transport_p50_us: _Optional[float] = ..., transport_p99_us: _Optional[float] = ..., part_p50_us: _Optional[_Mapping[str, float]] = ..., part_p99_us: _Optional[_Mapping[str, float]] = ...) -> None: ...

class CoreStats(_message.Message):
    __slots__ = ("running_requests", "waiting_requests", "prompt_tokens_total", "generation_tokens_total", "kv_cache_bytes", "layer_calls", "prefix_cache", "kv_cache_default", "problems", "kv_cache_capacity_bytes", "workers", "layer_latency", "speculative", "mlx_active_bytes", "mlx_cache_bytes", "image_cache")
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYER_CALLS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    LAYER_LATENCY_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    MLX_ACTIVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MLX_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_CACHE_FIELD_NUMBER: _ClassVar[int]
    running_requests: int
    waiting_requests: int
    prompt_tokens_total: int
    generation_tokens_total: int
    kv_cache_bytes: int
    layer_calls: LayerCallStats
    prefix_cache: PrefixCacheStats
    kv_cache_default: str
    problems: _containers.RepeatedScalarFieldContainer[str]
    kv_cache_capacity_bytes: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    layer_latency: _containers.RepeatedCompositeFieldContainer[LayerLatency]
    speculative: SpeculativeStats
    mlx_active_bytes: int
    mlx_cache_bytes: int
    image_cache: ImageCacheStats
    def __init__(self, running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., prompt_tokens_total: _Optional[int] = ..., generation_tokens_total: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., layer_calls: _Optional[_Union[LayerCallStats, _Mapping]] = ..., prefix_cache: _Optional[_Union[PrefixCacheStats, _Mapping]] = ..., kv_cache_default: _Optional[str] = ..., problems: _Optional[_Iterable[str]] = ..., kv_cache_capacity_bytes: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., layer_latency: _Optional[_Iterable[_Union[LayerLatency, _Mapping]]] = ..., speculative: _Optional[_Union[SpeculativeStats, _Mapping]] = ..., mlx_active_bytes: _Optional[int] = ..., mlx_cache_bytes: _Optional[int] = ..., image_cache: _Optional[_Union[ImageCacheStats, _Mapping]] = ...) -> None: ...

class ImageCacheStats(_message.Message):
    __slots__ = ("hits", "misses", "entries", "bytes", "budget_bytes")
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    hits: int
    misses: int
    entries: int
    bytes: int
    budget_bytes: int
    def __init__(self, hits: _Optional[int] = ..., misses: _Optional[int] = ..., entries: _Optional[int] = ..., bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ...) -> None: ...

class SpeculativeStats(_message.Message):
    __slots__ = ("method", "drafts", "draft_tokens", "accepted_tokens", "accepted_per_position")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    method: str
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, method: _Optional[str] = ..., drafts: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., accepted_per_position: _Optional[_Iterable[int]] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("address", "worker_id", "up", "last_error", "layers", "experts", "min_replicas", "memory_budget_bytes", "resident_bytes", "cache_hits", "cache_misses", "bytes_read", "read_gbps", "calls", "errors", "retries")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    MIN_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    CACHE_MISSES_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    READ_GBPS_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    RETRIES_FIELD_NUMBER: _ClassVar[int]
    address: str
    worker_id: str
    up: bool
    last_error: str
    layers: str
    experts: str
    min_replicas: int
    memory_budget_bytes: int
    resident_bytes: int
    cache_hits: int
    cache_misses: int
    bytes_read: int
    read_gbps: float
    calls: int
    errors: int
    retries: int
    def __init__(self, address: _Optional[str] = ..., worker_id: _Optional[str] = ..., up: _Optional[bool] = ..., last_error: _Optional[str] = ..., layers: _Optional[str] = ..., experts: _Optional[str] = ..., min_replicas: _Optional[int] = ..., memory_budget_bytes: _Optional[int] = ..., resident_bytes: _Optional[int] = ..., cache_hits: _Optional[int] = ..., cache_misses: _Optional[int] = ..., bytes_read: _Optional[int] = ..., read_gbps: _Optional[float] = ..., calls: _Optional[int] = ..., errors: _Optional[int] = ..., retries: _Optional[int] = ...) -> None: ...

class LayerLatency(_message.Message):
    __slots__ = ("layer", "calls", "p50_us", "p99_us")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    P50_US_FIELD_NUMBER: _ClassVar[int]
    P99_US_FIELD_NUMBER: _ClassVar[int]
    layer: int
    calls: int
    p50_us: float
    p99_us: float
    def __init__(self, layer: _Optional[int] = ..., calls: _Optional[int] = ..., p50_us: _Optional[float] = ..., p99_us: _Optional[float] = ...) -> None: ...

class ServiceMetrics(_message.Message):
    __slots__ = ("service", "worker", "text", "error")
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    service: str
    worker: str
    text: str
    error: str
    def __init__(self, service: _Optional[str] = ..., worker: _Optional[str] = ..., text: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class GetMetricsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetMetricsResponse(_message.Message):
    __slots__ = ("services",)
    SERVICES_FIELD_NUMBER: _ClassVar[int]
    services: _containers.RepeatedCompositeFieldContainer[ServiceMetrics]
    def __init__(self, services: _Optional[_Iterable[_Union[ServiceMetrics, _Mapping]]] = ...) -> None: ...

class PrefixCacheStats(_message.Message):
    __slots__ = ("lookups", "hits", "hit_tokens", "entries", "bytes", "budget_bytes")
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    lookups: int
    hits: int
    hit_tokens: int
    entries: int
    bytes: int
    budget_bytes: int
    def __init__(self, lookups: _Optional[int] = ..., hits: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., entries: _Optional[int] = ..., bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ...) -> None: ...
