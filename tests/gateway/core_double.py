"""A real grpc.aio Core server with scripted, deterministic behaviour, for gateway tests.

It streams the words of "The capital of France is Paris." as text deltas (one token id each),
records every request and its metadata, and can be told (through `CoreDouble.script`) to abort
with a status code, to stream slowly, to stream thinking text first (`reasoning`, as core's
reasoning parser emits it), to return tool calls (complete, one chunk each, as core's tool parser
emits them), or to end without a finish reason. `echo` requests get the prompt in front of the first
generated text, as core sends it; `GetStats` reports the Generate calls in flight as running.
It runs on its own event loop in a background thread, so tests may call the gateway with blocking
clients (the sync `openai` client) without starving it.
"""

from __future__ import annotations

import asyncio
import codecs
import threading
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.proto.moemesh.v1 import core_pb2, core_pb2_grpc

ANSWER_WORDS = ["The", " capital", " of", " France", " is", " Paris", "."]
ANSWER = "".join(ANSWER_WORDS)
FIRST_TOKEN_ID = 100
MODEL_ID = "tiny-moe"


@dataclass
class Script:
    """What the next Generate calls do. Replaced wholesale by tests (`double.script = Script(...)`)."""

    words: list[str] = field(default_factory=lambda: list(ANSWER_WORDS))
    delay_before_first_s: float = 0.0
    delay_per_chunk_s: float = 0.0
    abort_code: grpc.StatusCode | None = None
    abort_message: str = "scripted failure"
    abort_after_chunks: int = 0  # chunks sent before the abort
    finish_reason: int = core_pb2.STOP
    tool_calls: list[core_pb2.ToolCall] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    send_finish_chunk: bool = True
    matched_stop: str = ""
    cached_prompt_tokens: int = 0
    # per token, its raw bytes (instead of `words`): text is sent as a real core does, a character
    # only once its last byte is in, and each logprob carries the token's bytes
    token_bytes: list[bytes] | None = None
    queue_seconds: float = 0.002
    prefill_seconds: float = 0.003


def prompt_token_count(request: core_pb2.GenerateRequest) -> int:
    """Deterministic stand-in for tokenizing: one token per whitespace-separated word."""
    if request.WhichOneof("input") == "prompt":
        return len(request.prompt.split())
    if request.WhichOneof("input") == "token_ids":
        return len(request.token_ids.ids)
    return sum(len(message.content.split()) for message in request.chat.messages)


def prompt_logprobs(request: core_pb2.GenerateRequest) -> list[core_pb2.TokenLogprob]:
    """The prompt scored, one token per word (each after the first with its leading space): the
    first token has no logprob, the others -1.0."""
    words = request.prompt.split(" ")
    tokens = [words[0]] + [" " + word for word in words[1:]]
    return [
        core_pb2.TokenLogprob(
            token_id=i,
            token=token,
            token_bytes=token.encode(),
            logprob=-1.0 if i else 0.0,
            top=[core_pb2.TopLogprob(token_id=i, token=token, logprob=-1.0)][
                : request.top_logprobs if i else 0
            ],
        )
        for i, token in enumerate(tokens)
    ]


class CoreDouble(core_pb2_grpc.CoreServicer):
    def __init__(self) -> None:
        self.script = Script()
        self.requests: list[core_pb2.GenerateRequest] = []
        self.metadata: list[dict[str, str]] = []
        self.cancelled = threading.Event()  # set when a Generate call is cancelled by the client
        self.generate_started = threading.Event()
        self.running = 0
        self.images_refused = ""  # ModelInfo.images_refused: why the model refuses images, if it does

    def reset(self) -> None:
        self.script = Script()
        self.images_refused = ""
        self.requests.clear()
        self.metadata.clear()
        self.cancelled.clear()
        self.generate_started.clear()

    async def Generate(self, request: core_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        script = self.script
        self.requests.append(request)
        self.metadata.append({key: value for key, value in context.invocation_metadata()})
        self.generate_started.set()
        self.running += 1
        try:
            if request.model and request.model != MODEL_ID:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"model {request.model!r} is not served")
            await asyncio.sleep(script.delay_before_first_s)
            echo = request.prompt if request.echo else ""  # core prepends it to the first text
            for index, thought in enumerate(script.reasoning):
                token_id = FIRST_TOKEN_ID - 1 - index
                yield core_pb2.GenerateChunk(
                    reasoning=thought, token_ids=[token_id], request_id=request.request_id
                )
            words = list(script.words)
            if script.token_bytes is not None:
                words = [b.decode("utf-8", errors="replace") for b in script.token_bytes]
            finish_reason = script.finish_reason
            if request.stopping.HasField("max_tokens") and request.stopping.max_tokens < len(words):
                words = words[: request.stopping.max_tokens]
                finish_reason = core_pb2.LENGTH
            prompt_entries = prompt_logprobs(request) if request.prompt_logprobs else []
            if not words and (echo or prompt_entries):  # max_tokens 0: the scored prompt alone
                yield core_pb2.GenerateChunk(text=echo, prompt_logprobs=prompt_entries)
            utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
            raw = script.token_bytes or [word.encode() for word in words]
            for index, (word, token_bytes) in enumerate(zip(words, raw, strict=False)):
                if script.abort_code is not None and index == script.abort_after_chunks:
                    await context.abort(script.abort_code, script.abort_message)
                if index:
                    await asyncio.sleep(script.delay_per_chunk_s)
                token_id = FIRST_TOKEN_ID + index
                text = utf8.decode(token_bytes)
                chunk = core_pb2.GenerateChunk(
                    text=echo + text, token_ids=[token_id], request_id=request.request_id
                )
                chunk.prompt_logprobs.extend(prompt_entries)
                echo, prompt_entries = "", []
                if request.logprobs:
                    chunk.logprobs.append(
                        core_pb2.TokenLogprob(
                            token_id=token_id,
                            token=token_bytes.decode("utf-8", errors="replace"),
                            token_bytes=token_bytes,
                            logprob=-0.5,
                            top=[core_pb2.TopLogprob(token_id=token_id, token=word, logprob=-0.5)][
                                : request.top_logprobs
                            ],
                        )
                    )
                yield chunk
            if script.abort_code is not None and script.abort_after_chunks >= len(words):
                await context.abort(script.abort_code, script.abort_message)
            if script.send_finish_chunk:
                yield core_pb2.GenerateChunk(
                    tool_calls=script.tool_calls,
                    finish_reason=finish_reason,
                    matched_stop=script.matched_stop,
                    usage=core_pb2.Usage(
                        prompt_tokens=prompt_token_count(request),
                        completion_tokens=len(words) + len(script.reasoning),
                        cached_prompt_tokens=script.cached_prompt_tokens,
                    ),
                    timings=core_pb2.RequestTimings(
                        queue_seconds=script.queue_seconds, prefill_seconds=script.prefill_seconds
                    ),
                    request_id=request.request_id,
                )
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        finally:
            self.running -= 1

    async def CountTokens(self, request: core_pb2.CountTokensRequest, context):
        words = sum(len(message.content.split()) for message in request.chat.messages)
        words += len(request.prompt.split())
        return core_pb2.CountTokensResponse(count=words, ids=range(words) if request.return_ids else ())

    async def Detokenize(self, request: core_pb2.DetokenizeRequest, context):
        return core_pb2.DetokenizeResponse(text=" ".join(f"w{i}" for i in request.ids))

    async def GetStats(self, request, context):
        return core_pb2.CoreStats(running_requests=self.running, waiting_requests=0)

    async def ListModels(self, request, context):
        return core_pb2.ListModelsResponse(
            models=[
                core_pb2.ModelInfo(
                    id=MODEL_ID,
                    model_type="mixtral",
                    context_length=2048,
                    created=1_700_000_000,
                    images_refused=self.images_refused,
                )
            ]
        )


class CoreDoubleServer:
    """Runs `CoreDouble` plus grpc.health on `target` (e.g. "unix:///tmp/x/core.sock") in a thread."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.double = CoreDouble()
        self._health = health.aio.HealthServicer()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="core-double", daemon=True)

    def start(self) -> CoreDoubleServer:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("core double did not start")
        return self

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", "moemesh.v1.Core"):
            asyncio.run_coroutine_threadsafe(self._health.set(service, status), self._loop).result(5)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        server = grpc.aio.server()
        core_pb2_grpc.add_CoreServicer_to_server(self.double, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        server.add_insecure_port(self.target)
        await server.start()
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self._health.set("moemesh.v1.Core", health_pb2.HealthCheckResponse.SERVING)
        self._ready.set()
        await self._stop.wait()
        await server.stop(grace=None)
