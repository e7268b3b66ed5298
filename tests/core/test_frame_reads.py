"""`receive_exact`, the one read both ends of the frame path use: exact sizes over chunked
arrivals, polling first then sleeping, deadlines and ends of stream; and the poll policy."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from services.common.frames import (
    HEADER,
    FrameError,
    frame,
    frame_length,
    receive_exact,
    spin_for,
    spin_seconds,
)


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield a, b
    a.close()
    b.close()


def _send_later(sock, chunks, gap_s):
    def run():
        for chunk in chunks:
            time.sleep(gap_s)
            sock.sendall(chunk)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.parametrize("spin_s", [0.0, 0.002, 0.5])
def test_exact_bytes_from_chunks_that_arrive_while_polling_and_after(pair, spin_s):
    reader, writer = pair
    payload = bytes(range(256)) * 40
    chunks = [payload[:7], payload[7:4000], payload[4000:]]
    sender = _send_later(writer, chunks, 0.01)  # the last chunk comes after a 2 ms poll gave up
    got = receive_exact(reader, len(payload), spin_s=spin_s, deadline=time.monotonic() + 10)
    sender.join()
    assert bytes(got) == payload
    assert reader.getblocking()  # polling leaves the socket blocking for the next reader
    writer.sendall(b"next")
    assert bytes(receive_exact(reader, 4)) == b"next"


@pytest.mark.parametrize("spin_s", [0.0, 0.05])
def test_end_of_stream_between_frames_is_none_inside_a_frame_an_error(pair, spin_s):
    reader, writer = pair
    writer.close()
    assert receive_exact(reader, 4, spin_s=spin_s, eof_ok=True) is None
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    b.sendall(b"ab")
    b.close()
    with pytest.raises(FrameError, match="inside a frame"):
        receive_exact(a, 4, spin_s=spin_s, eof_ok=True)
    a.close()


@pytest.mark.parametrize("spin_s", [0.0, 1.0])
def test_the_deadline_bounds_the_wait_polling_included(pair, spin_s):
    reader, _ = pair
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        receive_exact(reader, 4, spin_s=spin_s, deadline=started + 0.2)
    assert time.monotonic() - started < 0.9  # a 1 s poll does not outlast a 0.2 s deadline


def test_a_large_frame_arrives_whole_across_buffer_growth(pair):
    reader, writer = pair
    payload = bytes(range(251)) * 15_000  # ~3.6 MiB: the buffer grows from 1 MiB twice
    sender = threading.Thread(target=writer.sendall, args=(payload,))
    sender.start()
    got = receive_exact(reader, len(payload), deadline=time.monotonic() + 30, grow=True)
    sender.join()
    assert bytes(got) == payload


def test_a_header_that_announces_much_and_sends_little_holds_little_memory(pair):
    """A stalled or hostile peer announcing a 256 MiB frame must not make the reader allocate it."""
    import tracemalloc

    reader, writer = pair
    writer.sendall(b"x" * 10)
    tracemalloc.start()
    try:
        with pytest.raises(TimeoutError):
            receive_exact(reader, 256 << 20, deadline=time.monotonic() + 0.2, grow=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak


def test_a_worker_connection_waits_idle_between_frames_past_the_body_deadline(short_tmp, monkeypatch):
    """The body of a frame has a deadline; the wait for the next frame has none (core may idle)."""
    from services.experts import frame_server
    from services.proto.moemesh.v1 import expert_pb2

    monkeypatch.setattr(frame_server, "BODY_TIMEOUT_S", 0.2)
    server = frame_server.FrameServer(
        str(short_tmp / "f.sock"), lambda call: expert_pb2.ExpertResult(call_id=call.call_id), 1 << 20
    )
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        client.connect(str(short_tmp / "f.sock"))
        for call_id in (1, 2):
            client.sendall(frame(expert_pb2.ExpertCall(call_id=call_id).SerializeToString()))
            size = frame_length(
                bytes(receive_exact(client, HEADER.size, deadline=time.monotonic() + 5)), 1 << 20
            )
            reply = expert_pb2.ExpertResult.FromString(
                bytes(receive_exact(client, size, deadline=time.monotonic() + 5))
            )
            assert reply.call_id == call_id
            time.sleep(0.5)  # idle longer than the body deadline
    finally:
        client.close()
        server.close()


def test_polling_only_where_every_process_has_a_core():
    assert spin_for(2, cores=2) > 0  # core + one worker on two cores
    assert spin_for(3, cores=2) == 0  # core + two workers would steal from the compute
    assert spin_for(9, cores=16) > 0
    assert spin_seconds(0) == 0 and spin_seconds(2500) == 0.0025
    with pytest.raises(SystemExit):
        spin_seconds(-1)
