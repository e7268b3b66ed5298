"""Binding a Unix socket takes over a path only from a process that is gone: a user's file and a
live service's socket stay; addresses that cannot be bound fail in one line."""

from __future__ import annotations

import socket

import pytest

from services.common.unix_sockets import MAX_PATH_BYTES, claim_socket_path
from tests.helpers import Workers, free_port, run_cli, serving, short_dir


def test_a_stale_socket_is_replaced_and_a_missing_folder_made(short_tmp):
    path = short_tmp / "stale.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()  # bound, never listened: connecting is refused, as after a killed process
    claim_socket_path(path)
    assert not path.exists()
    claim_socket_path(short_tmp / "new" / "w.sock")
    assert (short_tmp / "new").is_dir()


def test_a_file_or_a_live_socket_is_never_taken(short_tmp):
    mine = short_tmp / "regular.sock"
    mine.write_text("hello")
    with pytest.raises(OSError, match="is not a socket"):
        claim_socket_path(mine)
    assert mine.read_text() == "hello"
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(short_tmp / "live.sock"))
    live.listen(1)
    try:
        with pytest.raises(OSError, match="another process is listening"):
            claim_socket_path(short_tmp / "live.sock")
        assert (short_tmp / "live.sock").exists()
    finally:
        live.close()


def test_a_path_too_long_is_named(short_tmp):
    path = short_tmp / ("y" * MAX_PATH_BYTES) / "w.sock"
    with pytest.raises(OSError, match="limit is"):
        claim_socket_path(path)


@pytest.mark.slow
def test_a_second_worker_on_a_live_path_or_a_busy_port_fails_in_one_line(tiny_models):
    split = tiny_models.split("qwen3_moe", None)
    workers = Workers(split, short_dir(), ["0-7"]).start()
    try:
        address = workers.addresses[0]
        second = run_cli("expert", "--split", str(split), "--listen", address, timeout=120)
        assert second.returncode != 0 and "another process is listening" in second.stderr
        assert "Traceback" not in second.stderr
        assert serving(address)  # the first worker still has its socket
        busy = socket.socket()
        busy.bind(("127.0.0.1", free_port()))
        busy.listen(1)
        try:
            port = busy.getsockname()[1]
            third = run_cli("expert", "--split", str(split), "--listen", f"127.0.0.1:{port}", timeout=120)
        finally:
            busy.close()
        assert third.returncode != 0 and "cannot listen on 127.0.0.1" in third.stderr
        assert "Traceback" not in third.stderr
    finally:
        workers.stop()
