"""The core's step loop: one thread, `schedule -> forward(batch) -> sample -> emit`.

Batching, chunked prefill and per-sequence sampling come from mlx-lm's own
`BatchGenerator` (the engine mlx-lm's server runs), so a request's tokens match
`mlx_lm.generate`. Around it this loop adds what a server needs: a bounded queue,
cancellation that frees the sequence and its KV cache at once, deadlines, stop
strings, and failure isolation — an expert worker that fails a layer call fails the
requests of that step with UNAVAILABLE naming the worker; the engine resets its
batch and keeps serving.

Everything MLX and every expert call happens on this thread; the gRPC servicer
talks to it only through `submit`/`cancel` (thread-safe) and per-request asyncio
queues that this thread fills with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from services.common.logging import get_logger
from services.core.expert_client import ExpertCallError
from services.core.request_prep import PreparedRequest
from services.core.text_output import TextEmitter
from services.proto.moemesh.v1 import core_pb2

log = get_logger(__name__)
FINISH = {"stop": core_pb2.FinishReason.STOP, "length": core_pb2.FinishReason.LENGTH}


@dataclass(frozen=True)
class EngineError:
    """Sent on a request's queue instead of a chunk when the request fails."""

    code: grpc.StatusCode
    message: str


class Overloaded(Exception):
    pass


@dataclass
class Sequence:
    request: PreparedRequest
    out: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    emitter: TextEmitter
    uid: int | None = None
    generated: int = 0
    done: bool = False

    def send(self, item) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


@dataclass
class EngineConfig:
    max_num_seqs: int = 16
    max_queue: int = 256
    prefill_step_size: int = 512
    idle_probe_s: float = 2.0


@dataclass
class EngineCounters:
    prompt_tokens: int = 0
    generation_tokens: int = 0


class Engine:
    def __init__(self, tokenizer, config: EngineConfig, loader: Callable[[], tuple]):
        """`loader()` runs first on the engine thread (expert links belong to that thread's
        event loop) and returns (model, probe_workers, layer_call_timings); probe_workers()
        -> problems, where an empty list means every expert of every layer is reachable."""
        self.tokenizer = tokenizer
        self.config = config
        self._loader = loader
        self.model = None
        self.probe_workers: Callable[[], list[str]] | None = None
        self.layer_call_timings = None
        self.problems: list[str] = ["the model is loading"]
        self.loaded = threading.Event()
        self.load_error: BaseException | None = None
        self.counters = EngineCounters()
        self._inbox: queue.Queue = queue.Queue()
        self._admitted = 0  # submitted and not yet finished: bounded by max_num_seqs + max_queue
        self._admitted_lock = threading.Lock()
        self._active: dict[int, Sequence] = {}
        self._stop = threading.Event()
        self._health_listeners: list[Callable[[bool], None]] = []
        self._generator: BatchGenerator | None = None
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    # ---- called from other threads ---------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout=10)

    def on_health(self, listener: Callable[[bool], None]) -> None:
        self._health_listeners.append(listener)

    @property
    def running(self) -> int:
        """Sequences in the running batch (decoding or being prefilled)."""
        return min(self._admitted, self.config.max_num_seqs)

    @property
    def waiting(self) -> int:
        """Admitted sequences waiting for a place in the batch."""
        return max(0, self._admitted - self.config.max_num_seqs)

    def submit(
        self, request: PreparedRequest, out: asyncio.Queue, loop: asyncio.AbstractEventLoop
    ) -> Sequence:
        with self._admitted_lock:
            if self._admitted >= self.config.max_num_seqs + self.config.max_queue:
                raise Overloaded(
                    f"core is at capacity: {self.config.max_num_seqs} running and {self.config.max_queue} waiting"
                )
            self._admitted += 1
        sequence = Sequence(request, out, loop, TextEmitter(self.tokenizer.detokenizer, request.stop_strings))
        self._inbox.put(("add", sequence))
        return sequence

    def cancel(self, sequence: Sequence) -> None:
        self._inbox.put(("cancel", sequence))

    # ---- the engine thread -----------------------------------------------------------------

    def _new_generator(self) -> BatchGenerator:
        return BatchGenerator(
            self.model,
            completion_batch_size=self.config.max_num_seqs,
            prefill_batch_size=self.config.max_num_seqs,
            prefill_step_size=self.config.prefill_step_size,
        )

    def _run(self) -> None:
        try:
            self.model, self.probe_workers, self.layer_call_timings = self._loader()
            self._generator = self._new_generator()
        except BaseException as error:  # reported by the server, which then exits
            self.load_error = error
            log.exception("model_load_failed")
            return
        finally:
            self.loaded.set()
        self._probe()
        last_probe = time.monotonic()
        while not self._stop.is_set():
            idle = not self._active
            # Probe often while a worker is missing, so service resumes soon after it returns.
            wait = 0.25 if self.problems else self.config.idle_probe_s
            try:
                item = self._inbox.get(timeout=wait) if idle else self._inbox.get_nowait()
            except queue.Empty:
                item = ...
            if item is None:
                break
            if item is not ...:
                self._handle(item)
                while True:  # take everything that arrived, then step once
                    try:
                        more = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    if more is None:
                        return
                    self._handle(more)
            if not self._active:
                if time.monotonic() - last_probe >= wait:
                    self._probe()
                    last_probe = time.monotonic()
                continue
            self._step()

    def _handle(self, item) -> None:
        kind, sequence = item
        if kind == "add":
            if self.problems:
                self._probe()  # a worker may be back
            if self.problems:
                self._release(sequence)
                sequence.send(EngineError(grpc.StatusCode.UNAVAILABLE, "; ".join(self.problems)))
                return
            request = sequence.request
            (uid,) = self._generator.insert(
                [request.prompt],
                max_tokens=[request.max_tokens],
                samplers=[request.sampler],
                logits_processors=[request.processors],
                stop_sequences=[request.stop_sequences],
            )
            sequence.uid = uid
            self._active[uid] = sequence
            self.counters.prompt_tokens += len(request.prompt)
        elif kind == "cancel" and sequence.uid in self._active and not sequence.done:
            self._finish(sequence, remove=True)

    def _step(self) -> None:
        try:
            with mx.stream(self._generator.stream):
                _, responses = self._generator._next()
        except ExpertCallError as error:
            self._fail_all(error.code, str(error))
            return
        except Exception as error:  # never let one bad step take the server down
            log.exception("engine_step_failed")
            self._fail_all(grpc.StatusCode.INTERNAL, f"generation failed: {error}")
            return
        for response in responses:
            sequence = self._active.get(response.uid)
            if sequence is not None:
                self._emit(sequence, response)
        now = time.monotonic()
        for sequence in list(self._active.values()):
            if sequence.request.deadline is not None and now > sequence.request.deadline:
                sequence.send(EngineError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed"))
                self._finish(sequence, remove=True)

    def _emit(self, sequence: Sequence, response) -> None:
        request = sequence.request
        sequence.generated += 1
        self.counters.generation_tokens += 1
        chunk = core_pb2.GenerateChunk(request_id=request.request_id, token_ids=[response.token])
        finish = FINISH.get(response.finish_reason) if response.finish_reason else None
        is_stop_token = response.finish_reason == "stop"
        if not is_stop_token:
            chunk.text = sequence.emitter.add(response.token)
        if request.logprobs:
            self._add_logprobs(chunk, response, request.top_logprobs)
        if sequence.emitter.stopped and finish is None:
            finish = core_pb2.FinishReason.STOP
            self._finish(sequence, remove=True)
        if finish is not None:
            chunk.text += sequence.emitter.finish()
            chunk.finish_reason = finish
            chunk.usage.prompt_tokens = len(request.prompt)
            chunk.usage.completion_tokens = sequence.generated
            if not sequence.done:
                self._finish(sequence, remove=False)
        sequence.send(chunk)

    def _add_logprobs(self, chunk, response, top: int) -> None:
        logprobs = response.logprobs
        entry = chunk.logprobs.add(
            token_id=response.token,
            token=self.tokenizer.decode([response.token]),
            logprob=logprobs[response.token].item(),
        )
        if top:
            best = mx.argpartition(-logprobs, kth=top - 1)[:top]
            best = best[mx.argsort(-logprobs[best])]
            for token_id, value in zip(best.tolist(), logprobs[best].tolist(), strict=True):
                entry.top.add(token_id=token_id, token=self.tokenizer.decode([token_id]), logprob=value)

    def _release(self, sequence: Sequence) -> None:
        sequence.done = True
        with self._admitted_lock:
            self._admitted -= 1

    def _finish(self, sequence: Sequence, remove: bool) -> None:
        self._release(sequence)
        self._active.pop(sequence.uid, None)
        if remove:
            self._generator.remove([sequence.uid])

    def _fail_all(self, code: grpc.StatusCode, message: str) -> None:
        """A step failed midway: every sequence in it is lost; start a clean batch."""
        log.error("step_failed", code=code.name, error=message, requests=len(self._active))
        for sequence in list(self._active.values()):
            self._release(sequence)
            sequence.send(EngineError(code, message))
        self._active.clear()
        self._generator = self._new_generator()
        self._probe()

    def _probe(self) -> None:
        if self.probe_workers is None:
            return
        problems = self.probe_workers()
        if problems != self.problems:
            log.warning("workers_changed", problems=problems) if problems else log.info("workers_ready")
            self.problems = problems
            for listener in self._health_listeners:
                listener(not problems)
