"""Fuzz targets: each feeds one input to a decoder that peers or users reach, and says whether it
was accepted or refused. A refusal must be the decoder's own error (the one its callers turn into
a precise gRPC status, an HTTP 400 or a one-line CLI message); anything else raises `Finding`.

The decoders: the worker's frame stream and its ExpertCall handling, Tensor decoding, the split's
manifest, cluster.toml, safetensors headers, and the OpenAI and Anthropic request mappers.
"""

from __future__ import annotations

import json
import socket
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import mlx.core as mx
import numpy as np
from google.protobuf.message import DecodeError
from pydantic import ValidationError

from bench.fuzz_mutate import mutate_bytes, mutate_json
from services.common import tensor_codec
from services.common.frames import FrameError, frame
from services.common.manifest import Manifest, ManifestError
from services.experts.frame_server import read_call
from services.ops.cluster import ClusterConfigError, cluster_from_toml, local_cluster_toml, parse_cluster
from services.proto.moemesh.v1 import expert_pb2, tensor_pb2
from services.tools.safetensors_header import SafetensorsHeaderError, parse_header

CALL_CAP = 1 << 20  # the fuzzed worker's call cap: small, so claimed sizes past it are refusals
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]


class Finding(Exception):
    """The decoder failed in a way it must not: the input and what happened."""


@dataclass
class Target:
    name: str
    seeds: list[bytes]
    run: Callable[[bytes], str]  # "accepted" or "refused"; raises Finding
    mutate: Callable = mutate_bytes


def guarded(run: Callable[[bytes], str], refusals: tuple) -> Callable[[bytes], str]:
    """`run`, with its documented refusals counted and every other exception a Finding."""

    def target(data: bytes) -> str:
        try:
            return run(data)
        except refusals:
            return "refused"
        except Finding:
            raise
        except Exception as error:
            raise Finding(f"{type(error).__name__}: {error}") from error

    return target


# ---- the worker: ExpertCall messages, and the frame stream that carries them ----


def expert_call_seeds(hidden_size: int, experts: list[int]) -> list[bytes]:
    rng = np.random.default_rng(0)
    seeds = []
    for tokens, dtype in ((1, mx.float32), (3, mx.bfloat16), (2, mx.float16)):
        hidden = mx.array(rng.standard_normal((tokens, hidden_size)).astype(np.float32)).astype(dtype)
        ids = mx.array(np.array([experts[:2]] * tokens, dtype=np.int32))
        call = expert_pb2.ExpertCall(
            call_id=tokens, layer=1, hidden=tensor_codec.encode(hidden), expert_ids=tensor_codec.encode(ids)
        )
        seeds.append(call.SerializeToString())
    return seeds


def expert_call_target(answer, seeds: list[bytes]) -> Target:
    """Bytes -> ExpertCall -> the worker's `answer`: a malformed call must come back as an
    INVALID_ARGUMENT result for its call id, never an exception or an INTERNAL error."""

    def run(data: bytes) -> str:
        call = expert_pb2.ExpertCall.FromString(data)
        return _judge(call, answer(call))

    return Target("expert_call", seeds, guarded(run, (DecodeError,)))


def _judge(call: expert_pb2.ExpertCall, result: expert_pb2.ExpertResult) -> str:
    if result.call_id != call.call_id:
        raise Finding(f"answered call {result.call_id} for call {call.call_id}")
    if not result.HasField("error"):
        return "accepted"
    if result.error.code != INVALID_ARGUMENT:
        raise Finding(f"error code {result.error.code}: {result.error.message}")
    return "refused"


def frame_stream_target(answer, seeds: list[bytes]) -> Target:
    """Bytes -> a worker's frame connection (a real socket pair): each call read is answered;
    the stream ends cleanly, or with the frame reader's own errors."""

    def run(data: bytes) -> str:
        reader, writer = socket.socketpair()
        try:
            writer.sendall(data)
            writer.shutdown(socket.SHUT_WR)
            answered = 0
            while (call := read_call(reader, CALL_CAP)) is not None:
                _judge(call, answer(call))
                answered += 1
            return "accepted" if answered else "refused"
        finally:
            reader.close()
            writer.close()

    stream_seeds = [frame(seed) for seed in seeds] + [frame(seeds[0]) + frame(seeds[-1])]
    return Target("frame_stream", stream_seeds, guarded(run, (FrameError, DecodeError, TimeoutError)))


def tensor_target() -> Target:
    """Bytes -> Tensor -> an MLX array of exactly the bytes it carries, or TensorDecodeError."""

    def run(data: bytes) -> str:
        tensor = tensor_pb2.Tensor.FromString(data)
        array = tensor_codec.decode(tensor, "hidden", CALL_CAP, ndim=2)
        if array.nbytes != len(tensor.data) or list(array.shape) != list(tensor.shape):
            raise Finding(f"decoded {array.shape} ({array.nbytes} bytes) from {list(tensor.shape)}")
        return "accepted"

    seeds = [
        tensor_codec.encode(mx.ones((2, 8), dtype=dtype)).SerializeToString()
        for dtype in (mx.float32, mx.bfloat16, mx.int32, mx.uint8)
    ]
    return Target("tensor", seeds, guarded(run, (DecodeError, tensor_codec.TensorDecodeError)))


# ---- files a user or a peer hands to the CLI ----


def manifest_target(seed: bytes) -> Target:
    def run(data: bytes) -> str:
        Manifest.from_json(data, "manifest.json")
        return "accepted"

    return Target("manifest", [seed], guarded(run, (ManifestError,)), mutate=mutate_json)


def cluster_targets() -> list[Target]:
    text = local_cluster_toml(
        Path("/split"),
        "unix:/tmp/core.sock",
        [("worker-0", "127.0.0.1:50061", "0-3"), ("w1", "unix:/tmp/w", "all")],
    ).encode()
    path = Path("/etc/moe-mesh/cluster.toml")

    def run_toml(data: bytes) -> str:
        cluster_from_toml(data, path)
        return "accepted"

    def run_tables(data: bytes) -> str:
        try:
            tables = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            return "refused"  # not a tree of tables: nothing for parse_cluster to see
        if not isinstance(tables, dict):
            return "refused"  # TOML's top level is always a table
        parse_cluster(tables, path)
        return "accepted"

    import tomllib

    as_json = json.dumps(tomllib.loads(text.decode())).encode()
    return [
        Target("cluster_toml", [text], guarded(run_toml, (ClusterConfigError,))),
        Target("cluster_tables", [as_json], guarded(run_tables, (ClusterConfigError,)), mutate=mutate_json),
    ]


def safetensors_target() -> Target:
    """Bytes -> a safetensors header check; a header it accepts must load in MLX as it said."""
    folder = Path(tempfile.mkdtemp(prefix="fuzz-st-"))
    seed_path = folder / "seed.safetensors"
    mx.save_safetensors(
        str(seed_path),
        {
            "a": mx.zeros((3, 4)),
            "b": mx.ones((2,), dtype=mx.bfloat16),
            "c": mx.zeros((2, 2), dtype=mx.uint32),
        },
        metadata={"format": "mlx"},
    )
    probe = folder / "probe.safetensors"

    def run(data: bytes) -> str:
        entries = parse_header(data, len(data), "probe")
        probe.write_bytes(data)
        loaded = mx.load(str(probe))
        if sorted(loaded) != sorted(entries):
            raise Finding(f"header names {sorted(entries)}, MLX loaded {sorted(loaded)}")
        return "accepted"

    seed = seed_path.read_bytes()
    (length,) = struct.unpack("<Q", seed[:8])
    header_only = seed[: 8 + length]  # a download cut short after its header
    return Target("safetensors_header", [seed, header_only], guarded(run, (SafetensorsHeaderError,)))


# ---- the HTTP APIs' request mappers (what runs between pydantic and core) ----

OPENAI_CHAT = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ],
    "temperature": 0.7,
    "top_p": 0.9,
    "max_tokens": 16,
    "stop": ["\n"],
    "seed": 3,
    "logprobs": True,
    "top_logprobs": 2,
    "stream": True,
    "stream_options": {"include_usage": True},
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "tool_choice": "auto",
    "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}},
}
OPENAI_COMPLETION = {
    "model": "m",
    "prompt": ["a", "b"],
    "max_tokens": 8,
    "logprobs": 2,
    "echo": False,
    "n": 1,
}
ANTHROPIC_MESSAGES = {
    "model": "m",
    "max_tokens": 32,
    "system": [{"type": "text", "text": "Be brief."}],
    "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "42"}]},
    ],
    "tools": [{"name": "f", "input_schema": {"type": "object"}}],
    "tool_choice": {"type": "auto"},
    "stop_sequences": ["END"],
    "temperature": 0.5,
    "stream": False,
}


def mapper_targets() -> list[Target]:
    from services.gateway.anthropic_mapping import build_messages_request
    from services.gateway.anthropic_schema import MessagesRequest
    from services.gateway.completions_schema import CompletionRequest
    from services.gateway.errors import OpenAIError
    from services.gateway.generate_mapping import build_chat_requests, build_completion_requests
    from services.gateway.openai_schema import ChatCompletionRequest

    def mapper(schema, build, before=lambda body: None):
        def run(data: bytes) -> str:
            try:  # FastAPI's order: JSON first (a 400 of its own), then the schema
                parsed = json.loads(data)
            except (ValueError, UnicodeDecodeError):
                return "refused"
            body = schema.model_validate(parsed)
            try:
                before(body)
                requests = build(body, "req-1")
            except OpenAIError as error:
                if error.status >= 500:
                    raise Finding(f"{error.status}: {error.message}") from error
                raise
            for request in requests if isinstance(requests, list) else [requests]:
                request.SerializeToString()  # what goes to core: every field must encode
            return "accepted"

        return run

    refusals = (ValidationError, OpenAIError)
    chat = mapper(ChatCompletionRequest, build_chat_requests, lambda b: b.include_usage_in_stream())
    completion = mapper(
        CompletionRequest,
        build_completion_requests,
        lambda b: (b.check_max_tokens(), b.include_usage_in_stream()),
    )
    messages = mapper(MessagesRequest, build_messages_request)
    return [
        Target("openai_chat", [json.dumps(OPENAI_CHAT).encode()], guarded(chat, refusals), mutate_json),
        Target(
            "openai_completions",
            [json.dumps(OPENAI_COMPLETION).encode()],
            guarded(completion, refusals),
            mutate_json,
        ),
        Target(
            "anthropic_messages",
            [json.dumps(ANTHROPIC_MESSAGES).encode()],
            guarded(messages, refusals),
            mutate_json,
        ),
    ]
