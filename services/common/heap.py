"""Give the C heap's free pages back to the system.

MLX on the CPU takes its buffers from malloc. glibc keeps what is freed in its arenas (and, after
large frees, raises its mmap threshold so later large buffers come from the arenas too), so a
process whose working set shrank after a burst keeps its peak RSS. `malloc_trim(0)` returns the
free pages. Elsewhere (macOS's allocator returns memory itself; Metal buffers are not malloc's)
this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_libc = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _libc.malloc_trim  # noqa: B018 - glibc only (musl has none)
    except (OSError, AttributeError):
        _libc = None


def trim_heap() -> bool:
    """Return the heap's free pages to the system; True where something was returned."""
    return bool(_libc.malloc_trim(0)) if _libc is not None else False
