"""The gRPC data path of ExpertDispatcher: a layer call's parts over the workers' Forward
streams, on the I/O loop, with failover to replicas within the call's deadline."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np

from services.common import tensor_codec
from services.common.logging import get_logger
from services.core.expert_link.links import ExpertCallError, WorkerLink, expert_call_message, status_code
from services.core.expert_link.pending import PendingCall
from services.core.expert_link.routes import CallPart, plan_parts

log = get_logger(__name__)

# What a replicated layer's attempt gets past its own deadline (which normally ends it first)
# before it is abandoned: enough for the deadline's cancellation to land, short against the budget.
ABANDON_AFTER_S = 0.25


class GrpcPathMixin:
    def _grpc_start(self, pending: PendingCall) -> None:
        """Hand the call to the gRPC streams (the I/O loop); its answer arrives in pending.replies."""
        budget = pending.seconds_left()
        # The coroutine object is made here; the loop only has to start it.
        roundtrip = self._roundtrip(
            pending.layer,
            pending.plan,
            pending.hidden,
            pending.ids,
            pending.request_ids,
            budget,
            pending.replies,
        )
        try:
            self.loop.call_soon_threadsafe(self.loop.create_task, roundtrip)
        except RuntimeError:  # the loop is closed: the dispatcher was closed
            roundtrip.close()
            raise

    async def _roundtrip(
        self, layer: int, plan: list[CallPart], hidden, ids, request_ids, budget_s: float, replies
    ) -> None:
        """Runs on the I/O loop; always answers through `replies`, never raises.
        `budget_s`: what is left of the call's deadline (the frame path may have used some).

        Answers (True, [(mask or None, rows, stats), ...]) or (False, ExpertCallError)."""
        deadline = self.loop.time() + budget_s
        done: list[tuple] = []
        failed_links: set[int] = set()  # out of this call for good, even if they still look up
        try:
            while plan:
                remaining = deadline - self.loop.time()
                if remaining <= 0:
                    raise ExpertCallError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"layer {layer}: no worker answered within {self.call_timeout_s:g} s",
                    )
                # With a replica to fall back on, a silent worker gets half of what is left,
                # so the retry still fits in the call's deadline.
                replicated = self.routes[layer][0].shape[1] > 1
                budget = remaining / 2 if replicated else remaining
                attempt = self._attempt_apart if replicated else self._attempt
                if len(plan) == 1:  # the common case: no gather, no extra task
                    try:
                        outcomes = [await attempt(plan[0], layer, budget, request_ids)]
                    except ExpertCallError as error:
                        outcomes = [error]
                else:
                    outcomes = await asyncio.gather(
                        *(attempt(part, layer, budget, request_ids) for part in plan),
                        return_exceptions=True,
                    )
                failed = []
                for part, outcome in zip(plan, outcomes, strict=True):
                    if isinstance(outcome, BaseException):
                        if not isinstance(outcome, ExpertCallError):
                            raise outcome
                        failed.append((part, outcome))
                    else:
                        done.append((part.mask, *outcome))
                failed_links.update(part.link for part, _ in failed)
                plan = self._replan(layer, failed, hidden, ids, failed_links) if failed else []
            replies.put((True, done))
        except ExpertCallError as error:
            replies.put((False, error))
        except Exception as error:  # noqa: BLE001 - the engine thread must always get an answer
            replies.put(
                (False, ExpertCallError(grpc.StatusCode.INTERNAL, f"layer {layer} call failed: {error!r}"))
            )

    def _replan(
        self, layer: int, failed: list, hidden: np.ndarray, ids: np.ndarray, exclude: set[int]
    ) -> list[CallPart]:
        """Move the failed parts' pairs to other live replicas, or raise naming what is missing."""
        pending = np.zeros(ids.shape, dtype=bool)
        for part, error in failed:
            if error.code == grpc.StatusCode.INVALID_ARGUMENT:
                raise error  # our call is malformed: every replica would say the same
            self.links[part.link].count_retry()
            if part.mask is None:
                pending[:] = True
            else:
                pending |= part.mask
        log.warning(
            "expert_call_retry",
            layer=layer,
            failed=[self.links[part.link].address for part, _ in failed],
            error=str(failed[0][1]),
        )
        owners = np.full(ids.shape, -1, dtype=np.int32)
        try:
            owners[pending] = self._choose(layer, ids[pending], next(self._rotation), tuple(exclude))
        except ExpertCallError as gap:  # name what failed and what is now missing
            causes = "; ".join(dict.fromkeys(str(error) for _, error in failed))
            raise ExpertCallError(grpc.StatusCode.UNAVAILABLE, f"{causes}; {gap}") from None
        return plan_parts(owners, hidden, ids)

    async def _attempt_apart(self, part: CallPart, layer: int, budget_s: float, request_ids) -> tuple:
        """`_attempt` for a replicated layer, where a silent worker's pairs must move on in time: the
        attempt runs as a task of its own and is left behind (cancelled, not awaited) when its
        budget is spent, so the retry never depends on the cancellation reaching an await inside
        gRPC. A full-suite run here once lost such a call: the attempt on a SIGSTOPped replica
        never returned after its cancel, and the other replica was never asked."""
        inner = asyncio.ensure_future(self._attempt(part, layer, budget_s, request_ids))
        done, _ = await asyncio.wait({inner}, timeout=budget_s + ABANDON_AFTER_S)
        if inner in done and not inner.cancelled():
            return inner.result()  # the answer, or the attempt's own ExpertCallError
        self._abandoned.add(inner)  # from now on its own bookkeeping is skipped (see _drop)
        self._deadlines.forget(inner)
        inner.cancel()
        inner.add_done_callback(self._abandoned.discard)
        inner.add_done_callback(lambda task: task.cancelled() or task.exception())  # retrieved
        link = self.links[part.link]
        self._drop(link)
        message = f"expert worker {link.address} did not answer layer {layer} within {budget_s:.3g} s"
        link.count_error(grpc.StatusCode.UNAVAILABLE, message)
        raise ExpertCallError(grpc.StatusCode.UNAVAILABLE, message)

    async def _attempt(self, part: CallPart, layer: int, budget_s: float, request_ids) -> tuple:
        link = self.links[part.link]
        link.count_call()
        task = asyncio.current_task()
        self._deadlines.watch(task, budget_s)
        try:
            return await self._one(link, layer, part.hidden, part.ids, request_ids)
        except asyncio.CancelledError:
            if not self._deadlines.expired(task):
                raise
            task.uncancel()
            self._drop(link)
            error = ExpertCallError(
                grpc.StatusCode.UNAVAILABLE,
                f"expert worker {link.address} did not answer layer {layer} within {budget_s:.3g} s",
            )
        except ExpertCallError as failure:
            error = failure
        finally:
            self._deadlines.forget(task)
        if task not in self._abandoned:  # (an abandoned attempt was counted when it was left)
            link.count_error(error.code, str(error))
        raise error

    def _drop(self, link: WorkerLink, failed: bool = True) -> None:
        """Reset the link's stream (a late reply must not be taken for the next call's) and, when
        `failed`, stop routing to it. Not from an attempt that was abandoned: that was done when it
        was left, and by now the link may carry a newer call's stream."""
        if asyncio.current_task() in self._abandoned:
            return
        link.reset()
        if failed:
            self._link_failed(link)

    async def _one(self, link: WorkerLink, layer: int, hidden: np.ndarray, ids: np.ndarray, request_ids):
        call = expert_call_message(layer, hidden, ids, request_ids)
        try:
            stream = link.open_stream()
            await stream.write(call)
            result = await stream.read()
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as error:
            self._drop(link)
            detail = error.details() if isinstance(error, grpc.aio.AioRpcError) else str(error)
            raise ExpertCallError(
                grpc.StatusCode.UNAVAILABLE, f"expert worker {link.address} is unavailable: {detail}"
            ) from None
        if result is grpc.aio.EOF:
            self._drop(link)
            raise ExpertCallError(
                grpc.StatusCode.UNAVAILABLE, f"expert worker {link.address} closed its stream"
            )
        if result.HasField("error"):
            raise ExpertCallError(
                status_code(result.error.code), f"expert worker {link.address}: {result.error.message}"
            )
        if result.call_id != call.call_id:
            self._drop(link, failed=False)
            raise ExpertCallError(
                grpc.StatusCode.INTERNAL, f"expert worker {link.address} answered out of order"
            )
        rows = tensor_codec.decode_numpy(result.output, "output", 1 << 40, ndim=2)
        return rows, result.stats

    def _lost(self, pending: PendingCall) -> ExpertCallError:
        """The error for a gRPC call that never answered; its links' streams are reset, so that
        a late answer cannot be read as the next call's and the next call opens a fresh stream."""
        links = [self.links[part.link] for part in pending.plan]
        for link in links:
            self.loop.call_soon_threadsafe(link.reset)
        addresses = ", ".join(dict.fromkeys(link.address for link in links))
        log.error("expert_call_lost", layer=pending.layer, workers=addresses)
        return ExpertCallError(
            grpc.StatusCode.UNAVAILABLE,
            f"layer {pending.layer}: no answer from {addresses} within {self.call_timeout_s:g} s "
            "(the call was lost; its streams were reset)",
        )
