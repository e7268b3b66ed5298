"""The same-host data path of ExpertDispatcher: a layer call's parts over the workers' frame
sockets (frame_link.py), sent and read on the engine thread."""

from __future__ import annotations

import grpc

from services.common import tensor_codec
from services.common.frames import FrameError
from services.common.logging import get_logger
from services.core.expert_link import metrics as expert_metrics
from services.core.expert_link.links import ExpertCallError, WorkerLink, expert_call_message, status_code
from services.core.expert_link.pending import PendingCall

log = get_logger(__name__)


class FramePathMixin:
    def _frames_send(self, pending: PendingCall) -> list | None:
        """Send the call's parts over the workers' frame sockets, on this (the engine) thread.
        None when the plan cannot go that way (a replicated layer, whose failover lives in the
        gRPC path; a worker without a frame socket) or a connection broke on the way: the call
        then goes through the gRPC streams, which retry, fail over or name what is missing."""
        layer, plan = pending.layer, pending.plan
        if not self.use_frames or self.routes[layer][0].shape[1] > 1:
            return None
        links = [self.links[part.link] for part in plan]
        frames = [link.frames for link in links]
        if not all(link.up for link in links) or any(f is None or not f.usable for f in frames):
            return None
        calls = [expert_call_message(layer, part.hidden, part.ids, pending.request_ids) for part in plan]
        pending.mark_sent()  # encoded: from here the time is the send's
        sent = 0
        try:
            for call, link, frame_link in zip(calls, links, frames, strict=True):
                link.count_call()
                sent += 1
                frame_link.send(call, pending.deadline)
        except FrameError as error:
            return self._frames_failed(pending, links[sent - 1], error)
        return calls

    def _frames_receive(self, pending: PendingCall) -> list[tuple] | None:
        """Every part's answer from its frame socket. None when a connection broke or a worker
        answered with an error other than INVALID_ARGUMENT (the caller then makes the same
        call through gRPC). A worker that does not answer in time fails the call here
        (UNAVAILABLE), within the call's deadline."""
        plan = pending.plan
        links = [self.links[part.link] for part in plan]
        replies = []
        try:
            for link in links:
                replies.append(link.frames.receive(pending.deadline))
        except FrameError as error:
            return self._frames_failed(pending, links[len(replies)], error)
        results = []
        for part, link, call, result in zip(plan, links, pending.frame_calls, replies, strict=True):
            if result.call_id != call.call_id:
                self._close_frames(pending)
                return None
            if result.HasField("error"):
                code = status_code(result.error.code)
                if code != grpc.StatusCode.INVALID_ARGUMENT:
                    return None  # the gRPC path retries it on a replica or names the failure
                message = f"expert worker {link.address}: {result.error.message}"
                link.count_error(code, message)
                expert_metrics.LAYER_CALL_FAILURES.labels(code.name).inc()
                raise ExpertCallError(code, message)
            rows = tensor_codec.decode_numpy(result.output, "output", 1 << 40, ndim=2)
            results.append((part.mask, rows, result.stats))
        return results

    def _frames_failed(self, pending: PendingCall, link: WorkerLink, error: FrameError) -> None:
        """A frame connection broke (None: use gRPC) or timed out (raises UNAVAILABLE)."""
        self._close_frames(pending)  # answers still in flight would be read as the next call's
        if not error.timed_out:
            log.info("frames_fallback", worker=link.address, layer=pending.layer, error=str(error))
            return None
        message = f"expert worker {link.address} did not answer layer {pending.layer} within {self.call_timeout_s:g} s"
        link.count_error(grpc.StatusCode.UNAVAILABLE, message)
        self.loop.call_soon_threadsafe(self._link_failed, link)
        expert_metrics.LAYER_CALL_FAILURES.labels("UNAVAILABLE").inc()
        raise ExpertCallError(grpc.StatusCode.UNAVAILABLE, message) from None

    def _close_frames(self, pending: PendingCall) -> None:
        for part in pending.plan:
            frames = self.links[part.link].frames
            if frames is not None:
                frames.close()
