"""Where a cache asks for the fused-kernel backend without importing how it is chosen.

kernel_select.py chooses (and registers itself here when imported); its self-check builds
caches, so the cache module cannot import it. Until something registers, caches encode
with the pure-MLX twin, as they would on a device without kernels.
"""

from __future__ import annotations

from collections.abc import Callable

_chooser: list[Callable[[], object]] = []  # at most one: the registered `choose`


def register(choose: Callable[[], object]) -> None:
    """`choose()` returns the backend module or None; it is called on each use."""
    _chooser[:] = [choose]


def current_backend():
    """The chosen fused-kernel backend module, or None (the twin serves)."""
    return _chooser[0]() if _chooser else None
