"""The core's step loop: one thread, `schedule -> forward(batch) -> sample -> emit`.

Each step plans every batch's forwards (batch_step.py) over moe-mesh's own scheduling state
(sequence_batch.py), in the order mlx-lm's `BatchGenerator` steps, and runs them in mlx-lm's
batch classes (merged KV caches, per-sequence sampling), so a request's tokens match
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
import threading
import time
from collections.abc import Callable

import grpc
import mlx.core as mx

from services.common.heap import trim_heap
from services.common.logging import get_logger
from services.common.mlx_threads import releasing_mlx
from services.core.admission import Admission
from services.core.engine_config import EngineConfig, EngineCounters
from services.core.engine_metrics import record_step
from services.core.expert_link.links import BATCH_REQUEST_IDS
from services.core.image_prefills import ImagePrefill, ImagePrefills
from services.core.inbox import EngineInbox
from services.core.kind_batches import BatchKey, KindBatches
from services.core.kv import KV_CACHE_KINDS
from services.core.logprobs import LogprobWriter
from services.core.prefill_pacer import PrefillPacer
from services.core.prefix_cache import PrefixCache
from services.core.prompt_start import PromptStart
from services.core.request_prep import PreparedRequest
from services.core.sequence import EngineError, Outbox, Sequence, step_failure
from services.core.sequence_output import SequenceOutput
from services.core.step_forwards import plan_step, run_step_forwards
from services.core.text_output import TextEmitter
from services.core.token_bytes import TokenBytes

log = get_logger(__name__)


def release_idle_memory(batches: KindBatches) -> None:
    """The last sequence left: batches, MLX's freed buffers and the heap's free pages go back, so
    idle memory is weights + the prefix cache, not the last burst's peak."""
    batches.reset()
    mx.clear_cache()
    trim_heap()


class Engine:
    def __init__(self, tokenizer, config: EngineConfig, loader: Callable[[], tuple]):
        """`loader()` runs first on the engine thread (expert links belong to that thread's
        event loop) and returns (model, probe_workers, layer_call_timings); probe_workers()
        -> problems, where an empty list means every expert of every layer is reachable."""
        self.tokenizer = tokenizer
        self.logprobs = LogprobWriter(tokenizer, TokenBytes(tokenizer))
        self.config = config
        self.pacer = PrefillPacer(config.max_step_seconds)
        self._loader = loader
        self.model = None
        self.probe_workers: Callable[[], list[str]] | None = None
        self.layer_call_timings = None
        self.problems: list[str] = ["the model is loading"]
        self.loaded = threading.Event()
        self.load_error: BaseException | None = None
        self.counters = EngineCounters()
        self.prefix_cache = PrefixCache(config.prefix_cache_bytes)
        self.kv_cache_bytes = 0  # KV bytes of the sequences in flight, refreshed every step
        self.kv_cache_capacity_bytes = 0  # what the batch could fill at 16 bits (set by whoever builds it)
        self.expert_links = None  # the ExpertDispatcher, when workers serve some layers (for stats)
        self._in_batch = 0  # sequences decoding or prefilling, refreshed every step
        self._inbox = EngineInbox(config.burst_gather_s, config.max_num_batched_tokens, config.max_num_seqs)
        self._admission = Admission(config.max_num_seqs, config.max_queue)
        self._active: dict[tuple[BatchKey, int], Sequence] = {}
        self._outbox = Outbox()  # a step's chunks go to their event loops together, at its end
        self._stop = threading.Event()
        self._health_listeners: list[Callable[[bool], None]] = []
        self.closers: list[Callable[[], None]] = []  # run by stop(), after the step loop ends
        self.step_failure = step_failure  # (error) -> (status, message) for the step's requests
        # perf_counter() since the engine thread has been working (arrivals, a step, releasing
        # memory, probing the workers); None while it waits for work
        self.busy_since: float | None = None
        # called if the engine thread dies: the server exits rather than hold requests for ever
        self.on_fatal: Callable[[BaseException], None] | None = None
        self.batches = KindBatches(config, self.counters, self._speculates)
        self.output = SequenceOutput(
            self.logprobs, self.counters, self.prefix_cache, self._finish, self.batches.kept_cache
        )
        self.prompt_start = PromptStart(self.prefix_cache, self.batches)
        self.image_prefills = ImagePrefills(
            lambda: self.prompt_start.vision, self.prompt_start.keep_prefilled
        )
        self._thread = threading.Thread(target=releasing_mlx(self._run), name="engine", daemon=True)

    # ---- called from other threads ---------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the step loop, then close the expert links (one left open can abort the exit)."""
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout=10)
        for close in self.closers:
            try:
                close()
            except Exception:  # stopping anyway; say what did not close cleanly
                log.exception("close_failed")

    def on_health(self, listener: Callable[[bool], None]) -> None:
        self._health_listeners.append(listener)

    kv_cache_kinds = KV_CACHE_KINDS

    @property
    def running(self) -> int:
        """Sequences in a running batch (decoding or being prefilled), as of the last step."""
        return min(self._in_batch, self._admission.count)

    @property
    def waiting(self) -> int:
        """Admitted sequences not yet in a batch."""
        return max(0, self._admission.count - self.running)

    def submit(
        self, request: PreparedRequest, out: asyncio.Queue, loop: asyncio.AbstractEventLoop
    ) -> Sequence:
        self._admission.admit()
        sequence = Sequence(
            request,
            out,
            loop,
            TextEmitter(self.tokenizer.detokenizer, request.output),
            self._outbox,
            kind=request.kv_cache or self.config.kv_cache,
        )
        self._inbox.put(("add", sequence))
        return sequence

    def cancel(self, sequence: Sequence) -> None:
        self._inbox.put(("cancel", sequence))

    # ---- the engine thread -----------------------------------------------------------------

    def _speculates(self, batch: BatchKey, uid: int) -> bool:
        return (sequence := self._active.get((batch, uid))) is not None and sequence.request.speculative

    def _run(self) -> None:
        try:
            self.model, self.probe_workers, self.layer_call_timings = self._loader()
            self.batches.use_model(self.model, self.tokenizer)
            self.prompt_start.vision = getattr(self.model, "vision_prefill", None)
        except BaseException as error:  # reported by the server, which then exits
            self.load_error = error
            log.exception("model_load_failed")
            return
        finally:
            self.loaded.set()
        try:
            self._serve()
        except BaseException as error:  # the loop could not even fail its requests cleanly
            log.critical("engine_thread_died", exc_info=error)
            if self.on_fatal is not None:
                self.on_fatal(error)

    def _serve(self) -> None:
        self._probe()
        last_probe = time.monotonic()
        while not self._stop.is_set():
            idle = not self._active and not self.image_prefills.pending
            # Probe often while a worker is missing, so service resumes soon after it returns.
            wait = 0.25 if self.problems else self.config.idle_probe_s
            items = self._inbox.take(wait if idle else 0.0, gather=idle)  # all that arrived: one step
            if items is None:
                break
            self.busy_since = time.perf_counter()
            try:
                if self._turn(items) or time.monotonic() - last_probe < wait:
                    continue
                self._probe()
                last_probe = time.monotonic()
            except Exception as error:  # noqa: BLE001 - one bad step must not take the server down
                self._fail_all(*self.step_failure(error))
            finally:
                self.busy_since = None

    def _turn(self, items: list) -> bool:
        """Take in what arrived and run a step if there is work. Whether there was work."""
        for kind, sequence in items:
            try:
                self._handle(kind, sequence)
            except Exception as error:  # noqa: BLE001 - this request fails, no other
                self._active.pop(sequence.key, None)
                self._refuse(sequence, error)
        if not self._active and not self.image_prefills.pending:
            return False
        self._outbox.holding = True
        try:
            self._step()
        finally:
            self._outbox.flush()
        if not self._active and not self.image_prefills.pending:
            release_idle_memory(self.batches)
        return True

    def _handle(self, kind: str, sequence: Sequence) -> None:
        if kind == "add":
            self._add(sequence)
        elif kind == "cancel" and sequence.key in self._active and not sequence.done:
            self._finish(sequence, remove=True)
        elif kind == "cancel" and self.image_prefills.take(lambda p: p.sequence is sequence):
            self._release(sequence)  # its prompt was still being prefilled: nothing else holds it

    def _add(self, sequence: Sequence) -> None:
        if self.problems:
            self._probe()  # a worker may be back
        if self.problems:
            self._release(sequence)
            sequence.send(EngineError(grpc.StatusCode.UNAVAILABLE, "; ".join(self.problems)))
            return
        request = sequence.request
        if request.prompt_logprobs:
            sequence.prompt_logprobs = [self.logprobs.entry(request.prompt[0])]  # no context: no logprob
        try:
            cache, cached, positions = self.prompt_start.cache_for(sequence)
            if request.images is not None and cached < len(request.prompt) - 1:
                self.image_prefills.add(ImagePrefill(sequence, cache, cached, cached, positions))
                return
            self._insert(sequence, cache, cached, cached)
        except Exception as error:  # noqa: BLE001 - a bad cache kind or settings: this request fails, no other
            self._refuse(sequence, error)

    def _insert(self, sequence: Sequence, cache: list, held: int, cached: int) -> None:
        """Put the sequence in its batch, with `cache` holding its first `held` prompt positions."""
        request = sequence.request
        try:
            cuts = [held, *(at for at in request.snapshot_at if at > held), len(request.prompt)]
            sequence.batch = self.batches.place(sequence.kind)
            sequence.uid = self.batches.batch(sequence.batch).insert(
                [request.prompt[a:b] for a, b in zip(cuts, cuts[1:], strict=False)],
                request.max_tokens,
                cache,
                request.prompt[:held],
                request.sampler,
                request.processors,
                request.stop_sequences,
            )
            self.batches.started(sequence.batch, sequence.uid, held, sequence.kept_draft_state)
        except Exception as error:  # noqa: BLE001 - this request fails, no other
            self._refuse(sequence, error)
            return
        sequence.cached_tokens = cached
        self._active[sequence.key] = sequence
        # The positions it holds already and its last token, which the step that samples its first
        # token feeds; the rest counts as prefill steps compute it (_step).
        self.counters.prompt_tokens += held + 1

    def _refuse(self, sequence: Sequence, error: Exception) -> None:
        log.exception("insert_failed")
        self._release(sequence)
        sequence.send(EngineError(grpc.StatusCode.INTERNAL, f"could not start the request: {error}"))

    def _step(self) -> None:
        started = time.monotonic()
        # The expert calls of this step carry these ids to the workers' logs.
        BATCH_REQUEST_IDS.set(
            tuple(s.request.request_id for s in self._active.values()) + self.image_prefills.request_ids()
        )
        # A failure from here on fails the step's requests in `_serve`, with step_failure's status.
        working = {batch for batch, _ in self._active}
        plan = plan_step(self.batches, working, self._scoring, self.config, self.pacer)
        self._in_batch = plan.in_batch  # a prompt prefilling counts as running from its first step
        forwards = run_step_forwards(plan, self.image_prefills, self.config)
        self.counters.prompt_tokens += plan.prompt_tokens
        if forwards.tasks:
            seconds = time.monotonic() - started
            record_step(self.pacer, forwards.tasks, plan.prompt_tokens, plan.decoding, seconds)
        for batch, outcome in forwards.outcomes.items():
            step = plan.steps[batch]
            self.output.deliver(batch, step.batch, step, outcome, self._active, started)
        for prefilled in self.image_prefills.ready():
            self._insert(prefilled.sequence, prefilled.cache, prefilled.done, prefilled.cached)
        self._refresh_gauges()
        if self.layer_call_timings is not None:
            self.layer_call_timings.record_part("engine_step", (time.monotonic() - started) * 1e6)
        self._expire_late()

    def _expire_late(self) -> None:
        now = time.monotonic()
        late = lambda s: s.request.deadline is not None and now > s.request.deadline  # noqa: E731
        prefilling = [p.sequence for p in self.image_prefills.take(lambda p: late(p.sequence))]
        for sequence in prefilling + [s for s in self._active.values() if late(s)]:
            sequence.send(EngineError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed"))
            self._finish(sequence, remove=sequence.key in self._active)

    def _scoring(self, batch: BatchKey) -> frozenset[int]:
        return frozenset(
            uid for (b, uid), s in self._active.items() if b == batch and s.request.prompt_logprobs
        )

    def _release(self, sequence: Sequence) -> None:
        self._admission.release(sequence)

    def _finish(self, sequence: Sequence, remove: bool, keep_prefix: bool = False) -> None:
        """The sequence leaves its batch. With `remove` its KV cache is freed now (a stop string,
        a cancel, a deadline); with `keep_prefix` what it computed goes to the prefix cache."""
        self._release(sequence)
        self._active.pop(sequence.key, None)
        keep = keep_prefix and self.prefix_cache.enabled
        for tokens, cache in self.batches.finished(sequence.batch, sequence.uid, remove, keep):
            self.prefix_cache.store(*sequence.prefix_entry(tokens), cache)
        if remove:
            self._refresh_gauges()  # a cancel between steps: no step follows to do it

    def _refresh_gauges(self) -> None:
        """KV bytes and sequences in the batches, as GetStats and /metrics report them."""
        self.kv_cache_bytes = self.batches.kv_bytes()
        self._in_batch = self.batches.sequences()

    def _fail_all(self, code: grpc.StatusCode, message: str) -> None:
        """A step failed midway: every sequence in flight is lost; the engine is idle again."""
        log.error("step_failed", code=code.name, error=message, requests=len(self._active))
        lost = list(self._active.values()) + [p.sequence for p in self.image_prefills.take(lambda p: True)]
        for sequence in lost:
            self._release(sequence)
        self._active.clear()
        try:
            release_idle_memory(self.batches)
        except RuntimeError as error:  # the failed work's error, raised again where MLX next waits
            log.warning("release_after_failed_step", error=str(error))
        self.kv_cache_bytes = self._in_batch = 0
        for sequence in lost:  # told once the engine is idle again, so a retry finds it clean
            sequence.send(EngineError(code, message))
        self._probe()

    def _probe(self) -> None:
        if self.probe_workers is None:
            return
        try:
            problems = self.probe_workers()
        except Exception as error:
            log.exception("probe_failed")
            problems = [f"core could not reach its expert workers: {error!r}"]
        if problems != self.problems:
            log.warning("workers_changed", problems=problems) if problems else log.info("workers_ready")
            self.problems = problems
            for listener in self._health_listeners:
                listener(not problems)
