"""How many tokens a sequence drafts next: fewer while its drafts are rejected, none for a while
when they keep failing, so text that drafts badly costs about what it costs without drafting."""

from __future__ import annotations

from dataclasses import dataclass

PAUSE_BELOW = 0.2  # mean acceptance under which drafting pauses
PAUSE_STEPS = 16  # steps a paused sequence decodes plainly before it tries again
WEIGHT = 0.5  # of the newest step in the running acceptance


@dataclass
class DraftPolicy:
    most: int
    length: int = 0
    acceptance: float = 1.0
    paused: int = 0

    def __post_init__(self):
        self.length = self.length or self.most

    def budget(self) -> int:
        if self.paused:
            self.paused -= 1
            return 0
        return self.length

    def observe(self, drafted: int, kept: int) -> None:
        if not drafted:
            return
        rate = kept / drafted
        self.acceptance = (1 - WEIGHT) * self.acceptance + WEIGHT * rate
        if kept == drafted:
            self.length = min(self.most, self.length + 1)
        else:
            self.length = max(1, kept + 1)
        if self.acceptance < PAUSE_BELOW:
            self.paused = PAUSE_STEPS
            self.acceptance = PAUSE_BELOW  # one good step after the pause resumes drafting
            self.length = 1
