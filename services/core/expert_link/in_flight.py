"""The engine thread's layer call in flight (ExpertDispatcher.call_overlapped), if any.

Anything in core that evaluates MLX arrays while a model forward runs must call
`settle_pending()` first: the placeholder of the call in flight gets its answer, and
nothing computed before that can have read it. `RemoteExperts` does so before each layer's
synchronisation, and so does every kernel backend that evaluates its inputs eagerly.
"""

from __future__ import annotations

import threading


class _InFlight(threading.local):
    call = None  # (dispatcher, pending) of this thread's call in flight


IN_FLIGHT = _InFlight()


def settle_pending() -> None:
    """Write the answer of this thread's call in flight (if any) into its placeholder; raises
    that call's ExpertCallError."""
    in_flight = IN_FLIGHT.call
    if in_flight is not None:
        IN_FLIGHT.call = None
        dispatcher, pending = in_flight
        dispatcher._finish(pending, pending.slot)


def drop_pending() -> None:
    """Forget this thread's call in flight, if any (the forward that made it failed)."""
    in_flight = IN_FLIGHT.call
    if in_flight is not None:
        IN_FLIGHT.call = None
        dispatcher, pending = in_flight
        dispatcher._abandon(pending)
