"""The engine thread's layer call in flight (ExpertDispatcher.call_overlapped), if any.

Anything in core that evaluates MLX arrays while a model forward runs must call
`settle_pending()` first: the placeholder of the call in flight gets its answer, and
nothing computed before that can have read it. `RemoteExperts` does so before each layer's
synchronisation, and so does every kernel backend that evaluates its inputs eagerly.

The slot is per thread because a call belongs to the engine thread that made it: two
engines in one process (tests) each settle only their own.
"""

from __future__ import annotations

import threading


class _InFlight(threading.local):
    call = None  # this thread's PendingCall in flight (services/core/expert_link/pending.py)


IN_FLIGHT = _InFlight()


def settle_pending() -> None:
    """Write the answer of this thread's call in flight (if any) into its placeholder; raises
    that call's ExpertCallError."""
    pending = IN_FLIGHT.call
    if pending is not None:
        IN_FLIGHT.call = None
        pending.settle()


def drop_pending() -> None:
    """Forget this thread's call in flight, if any (the forward that made it failed)."""
    pending = IN_FLIGHT.call
    if pending is not None:
        IN_FLIGHT.call = None
        pending.abandon()
