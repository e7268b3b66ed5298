"""Threads that run MLX must free MLX's per-thread state themselves before they end.

MLX keeps streams (on the CPU each with its own scheduler thread) and compiled graphs per thread.
Since mlx 0.32 only the main thread's are freed for you (at interpreter exit); another thread's
are destroyed by C++ thread-local destructors when the thread ends, without the GIL and racing
the interpreter, which aborts the process now and then ("terminate called without an active
exception", SIGABRT; ml-explore/mlx#4327 and #4373: "it is still required to call
`mx.clear_streams()` in each worker thread"). A core stopping on SIGTERM exited -6 instead of 0
that way. So every thread that may run MLX ends through `release_mlx()`: the engine thread, the
experts' compute threads, and the single-thread executors below.

`release_mlx()` must be the thread's last MLX call: the thread's streams are gone after it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx


def release_mlx() -> None:
    """Free this thread's MLX streams and compiled graphs now, while the GIL is held."""
    mx.clear_streams()


def releasing_mlx(target: Callable[..., None]) -> Callable[..., None]:
    """`target` for a threading.Thread that may run MLX: it releases MLX however it ends."""

    @functools.wraps(target)
    def run(*args, **kwargs) -> None:
        try:
            target(*args, **kwargs)
        finally:
            release_mlx()

    return run


class MlxThread(ThreadPoolExecutor):
    """One worker thread for calls that may run MLX (an executor for `run_in_executor`).
    `close()` runs `release_mlx` on that thread as its last task, then waits for it to end;
    call it when the owner stops (an executor left to interpreter exit ends its thread unreleased)."""

    def __init__(self, name: str):
        super().__init__(max_workers=1, thread_name_prefix=name)

    def close(self) -> None:
        try:
            self.submit(release_mlx)
        except RuntimeError:  # already shut down
            return
        self.shutdown(wait=True)
