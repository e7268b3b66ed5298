"""Token ids -> streamed text, with stop strings cut out.

Text that might be the start of a stop string is held back until it is known not
to be one, so a stop string never reaches the client, even split across tokens.
"""

from __future__ import annotations


class TextEmitter:
    def __init__(self, detokenizer, stop_strings: list[str]):
        self.detokenizer = detokenizer
        self.stop_strings = [s for s in stop_strings if s]
        self.pending = ""  # decoded but not yet sent (could begin a stop string)
        self.stopped = False

    def add(self, token: int) -> str:
        """Feed one token; return the text that is safe to send now."""
        self.detokenizer.add_token(token)
        self.pending += self.detokenizer.last_segment
        return self._release()

    def finish(self) -> str:
        """End of generation: flush everything still held (minus any stop string)."""
        self.detokenizer.finalize()
        self.pending += self.detokenizer.last_segment
        text = self._release(final=True)
        return text

    def _release(self, final: bool = False) -> str:
        if self.stopped:
            return ""
        cut = min((i for i in (self.pending.find(s) for s in self.stop_strings) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            text, self.pending = self.pending[:cut], ""
            return text
        if final or not self.stop_strings:
            text, self.pending = self.pending, ""
            return text
        hold = 0
        for stop in self.stop_strings:
            for length in range(min(len(stop) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(stop[:length]):
                    hold = max(hold, length)
                    break
        text = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold :]
        return text
