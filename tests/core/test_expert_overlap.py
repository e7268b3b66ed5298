"""Overlapped layer calls (ExpertDispatcher.call_overlapped): core builds the next layer's graph
while a layer's experts compute, and the answer lands in a placeholder before anything is
evaluated. Real worker processes on Unix sockets, over frames and over gRPC."""

from __future__ import annotations

import asyncio
import time

import grpc
import mlx.core as mx
import numpy as np
import pytest

from services.core.expert_link import dispatcher as expert_client
from services.core.expert_link.dispatcher import ExpertCallError, ExpertDispatcher
from services.core.expert_link.in_flight import drop_pending, settle_pending
from services.core.expert_link.step_merge import expert_call, run_side_by_side
from tests.core.test_frames import _inputs, assert_fails_naming_worker
from tests.helpers import linked_dispatcher

pytestmark = pytest.mark.slow  # starts worker processes


@pytest.fixture(scope="module")
def split(tiny_models):
    return tiny_models.split("qwen3_moe", None)


@pytest.mark.parametrize("frames", [True, False], ids=["frames", "grpc"])
def test_a_graph_built_on_the_placeholder_sees_the_answer(split, tmp_path, frames):
    with linked_dispatcher(split, tmp_path, ["0-3", "4-7"], frames=frames, overlap=True) as (
        _,
        dispatcher,
        manifest,
    ):
        first, last = manifest.layer_indices[0], manifest.layer_indices[-1]
        assert first != last
        hidden, ids = _inputs(manifest)
        expected = dispatcher.call(first, hidden, ids)
        placeholder = dispatcher.call_overlapped(first, hidden, ids)
        assert placeholder.shape == expected.shape and placeholder.dtype == expected.dtype
        built_before = (placeholder * 2).sum(axis=1)  # lazy: what the next layer would do with it
        settle_pending()
        np.testing.assert_array_equal(np.array(built_before), np.array((expected * 2).sum(axis=1)))
        np.testing.assert_array_equal(np.array(placeholder), np.array(expected))
        # The last layer's answer is needed for the model's output: it never stays in flight.
        at_once = dispatcher.call_overlapped(last, hidden, ids)
        np.testing.assert_array_equal(np.array(at_once), np.array(dispatcher.call(last, hidden, ids)))


def test_the_placeholder_is_nan_until_settled_and_overlap_can_be_turned_off(split, tmp_path):
    with linked_dispatcher(split, tmp_path, ["0-7"], overlap=True) as (workers, dispatcher, manifest):
        layer = manifest.layer_indices[0]
        hidden, ids = _inputs(manifest)
        placeholder = dispatcher.call_overlapped(layer, hidden, ids)
        assert np.isnan(np.array(placeholder)).all()  # read too early: no number passes for an answer
        settle_pending()
        assert not np.isnan(np.array(placeholder)).any()
        plain = ExpertDispatcher(manifest, workers.addresses, overlap=False)
        try:
            assert plain.discover() == []
            got = plain.call_overlapped(layer, hidden, ids)
            np.testing.assert_array_equal(np.array(got), np.array(placeholder))
        finally:
            plain.close()


@pytest.mark.parametrize("frames", [True, False], ids=["frames", "grpc"])
def test_a_dropped_call_is_never_read_as_the_next_ones_answer(split, tmp_path, frames):
    with linked_dispatcher(split, tmp_path, ["0-7"], frames=frames, overlap=True) as (
        _,
        dispatcher,
        manifest,
    ):
        layer = manifest.layer_indices[0]
        one, ids_one = _inputs(manifest, seed=1)
        two, ids_two = _inputs(manifest, seed=2)
        expected = np.array(dispatcher.call(layer, two, ids_two))
        dispatcher.call_overlapped(layer, one, ids_one)
        drop_pending()  # e.g. the forward failed before the next layer
        settle_pending()  # nothing in flight any more: a no-op
        np.testing.assert_array_equal(np.array(dispatcher.call(layer, two, ids_two)), expected)


def test_a_worker_killed_while_its_answer_is_in_flight_fails_the_settle_naming_it(split, tmp_path):
    with linked_dispatcher(split, tmp_path, ["0-7"], call_timeout_s=10.0, overlap=True) as (
        workers,
        dispatcher,
        manifest,
    ):
        layer = manifest.layer_indices[0]
        hidden, ids = _inputs(manifest)
        dispatcher.call(layer, hidden, ids)
        workers.kill(0)

        def call_then_settle():
            dispatcher.call_overlapped(layer, hidden, ids)
            settle_pending()

        assert_fails_naming_worker(workers, 0, dispatcher, call_then_settle)
        settle_pending()  # the failed call is not in flight any more


def test_a_failing_step_leaves_no_call_in_flight(split, tmp_path):
    with linked_dispatcher(split, tmp_path, ["0-7"], overlap=True) as (_, dispatcher, manifest):
        first, second = manifest.layer_indices[:2]
        hidden, ids = _inputs(manifest)
        expected = np.array(dispatcher.call(second, hidden, ids))

        def forward_that_fails():
            expert_call(dispatcher, first, hidden, ids)  # in flight now
            raise ValueError("a bug between two layers")

        with pytest.raises(ValueError):
            run_side_by_side([forward_that_fails])
        # The next step's first call gets its own answer, not the dropped one's.
        got = expert_call(dispatcher, second, hidden, ids)
        settle_pending()
        np.testing.assert_array_equal(np.array(got), expected)


def test_a_model_that_evaluates_mid_forward_turns_overlap_off_with_a_clear_error(split, tmp_path):
    with linked_dispatcher(split, tmp_path, ["0-7"], overlap=True) as (_, dispatcher, manifest):
        first, second = manifest.layer_indices[:2]
        hidden, ids = _inputs(manifest)
        expected = np.array(dispatcher.call(second, hidden, ids)[:, 0])
        placeholder = dispatcher.call_overlapped(first, hidden, ids)
        early = placeholder[:, 0] + 0
        mx.eval(early)  # what an architecture evaluating inside its forward would do: NaN
        with pytest.raises(ExpertCallError) as error:
            dispatcher.call_overlapped(second, early, ids)
        assert error.value.code == grpc.StatusCode.INTERNAL
        assert "--expert-overlap off" in str(error.value)
        assert dispatcher.overlap is False
        settle_pending()
        got = dispatcher.call_overlapped(second, hidden, ids)  # answered at once from now on
        np.testing.assert_array_equal(np.array(got[:, 0]), expected)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_has_nan_reads_the_wire_form(dtype):
    from services.common.tensor_codec import has_nan, numpy_view

    clean = mx.array([[1.0, -2.0, float("inf")]]).astype(dtype)
    assert not has_nan(numpy_view(clean), dtype)
    assert has_nan(numpy_view(mx.array([[1.0, float("nan"), 0.0]]).astype(dtype)), dtype)
    from services.common.tensor_codec import nan_of

    assert has_nan(np.array([nan_of(dtype)]), dtype)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_a_graph_built_before_a_host_write_into_the_placeholder_sees_it(dtype):
    """The device property overlap rests on (run this file on a GPU host to check one)."""
    from services.common.tensor_codec import numpy_view
    from services.core.expert_link.pending import PendingCall

    hidden = numpy_view(mx.zeros((3, 64), dtype))  # the call's states, in their wire form
    pending = PendingCall(None, 0, [], hidden, np.zeros((3, 8), np.int32), 0.0, 0.0, dtype)
    slot = pending.make_slot()
    assert slot.dtype == dtype
    weight = mx.random.normal((64, 64), key=mx.random.key(0)).astype(dtype)
    built_before = (slot.reshape(-1, 64) @ weight).sum(axis=0)
    answer = mx.random.normal((3, 8, 64), key=mx.random.key(1)).astype(dtype)
    mx.eval(answer, weight)
    wire = answer.view(mx.uint16) if dtype == mx.bfloat16 else answer
    pending.slot[...] = np.array(wire)
    expected = (answer.reshape(-1, 64) @ weight).sum(axis=0)
    assert mx.allclose(built_before, expected).item()


def _answered_call(dispatcher, manifest):
    """The first MoE layer, a call's inputs, and the answer the workers give it while all is well."""
    layer = manifest.layer_indices[0]
    hidden, ids = _inputs(manifest)
    return layer, hidden, ids, np.array(dispatcher.call(layer, hidden, ids))


def test_a_call_the_io_loop_never_answers_fails_instead_of_hanging(split, tmp_path, monkeypatch):
    """Whatever goes wrong on the I/O loop, the engine thread waits at most the call deadline plus
    a grace: the layer call fails with UNAVAILABLE naming the worker, and the next call works."""
    monkeypatch.setattr(expert_client, "REPLY_GRACE_S", 0.2)
    with linked_dispatcher(split, tmp_path, ["0-7"], call_timeout_s=1.0, frames=False) as (
        workers,
        dispatcher,
        manifest,
    ):
        layer, hidden, ids, expected = _answered_call(dispatcher, manifest)

        async def never_answers(*args):
            await asyncio.sleep(3600)

        monkeypatch.setattr(dispatcher, "_roundtrip", never_answers)
        started = time.monotonic()
        with pytest.raises(ExpertCallError) as failure:
            dispatcher.call(layer, hidden, ids)
        assert time.monotonic() - started < 5
        assert failure.value.code == grpc.StatusCode.UNAVAILABLE
        assert workers.addresses[0] in str(failure.value) and "lost" in str(failure.value)
        monkeypatch.undo()
        np.testing.assert_array_equal(np.array(dispatcher.call(layer, hidden, ids)), expected)


def test_a_replica_whose_await_swallows_the_cancel_is_left_behind(split, tmp_path, monkeypatch):
    """A replicated layer's pairs move to the other replica in time even when the silent replica's
    attempt does not end on its deadline's cancellation (an await inside gRPC that swallows it):
    the same answer, within the call deadline, not a lost call."""
    with linked_dispatcher(split, tmp_path, ["0-7", "0-7"], call_timeout_s=4.0, frames=False) as (
        workers,
        dispatcher,
        manifest,
    ):
        layer, hidden, ids, expected = _answered_call(dispatcher, manifest)
        original = dispatcher._one
        silent = dispatcher.links[0]

        async def deaf_to_cancel(link, *args):
            if link is not silent:
                return await original(link, *args)
            while True:  # a stopped peer, and a cancellation that never surfaces
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    continue

        monkeypatch.setattr(dispatcher, "_one", deaf_to_cancel)
        for _ in range(2):  # whichever replica the rotation picks first
            started = time.monotonic()
            np.testing.assert_array_equal(np.array(dispatcher.call(layer, hidden, ids)), expected)
            assert time.monotonic() - started < 4.0
