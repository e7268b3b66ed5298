"""How many tokens a sequence drafts next: as many as pay for themselves at its acceptance and at
what a drafted token costs here, fewer while its drafts are rejected, and none for a while when
they keep failing, so text that drafts badly costs about what it costs without drafting.

Worth it: with per-token acceptance a, a step that drafts k tokens yields on average
1 + a + ... + a^k tokens and costs 1 + c * k plain steps, where c is what one drafted token adds to
a step: drafting it and verifying its position (`StepCosts`, measured by the engine's own steps).
Where the hop dominates a step (a GPU, a network) c is small and drafting pays at low acceptance;
where a step's cost is its compute (a CPU), or a draft model costs as much as the served one, c is
large and only well-accepted drafts pay, or none.
"""

from __future__ import annotations

from dataclasses import dataclass

PAUSE_BELOW = 0.2  # mean acceptance under which drafting pauses
PAUSE_STEPS = 16  # steps a paused sequence decodes plainly before it tries again
MAX_PAUSE_STEPS = 1024  # each pause that follows a failed try is twice as long, up to this
WEIGHT = 0.5  # of the newest step in the running acceptance
MARGIN = 1.02  # a gain within noise is not worth a longer step


def worth_drafting(acceptance: float, per_draft: float, most: int) -> int:
    """The draft length (0..most) with the most tokens per unit of step cost."""
    best, best_gain, expected = 0, 1.0, 1.0
    for k in range(1, most + 1):
        expected += acceptance**k
        gain = expected / (1.0 + per_draft * k)
        if gain > best_gain * MARGIN:
            best, best_gain = k, gain
    return best


@dataclass
class DraftPolicy:
    """One sequence's drafting: `budget(per_draft)` before each step, `observe` after a draft."""

    most: int
    length: int = 0
    acceptance: float = 1.0
    paused: int = 0
    probe: bool = False  # the first step after a pause drafts one token, whatever it is worth
    pause_steps: int = PAUSE_STEPS  # the next pause's length

    def __post_init__(self):
        self.length = self.length or self.most

    def budget(self, per_draft: float | None = None) -> int:
        """Drafts for the next step. per_draft: what a drafted token costs, in plain steps (None
        while unmeasured: draft the current length)."""
        if self.paused:
            self.paused -= 1
            return 0
        if self.probe:  # acceptance is only measured where something is drafted
            self.probe = False
            return 1
        if per_draft is None:
            return self.length
        if per_draft >= 1.0:  # no acceptance pays for it: StepCosts stops and retries every row
            return 0
        worth = worth_drafting(self.acceptance, per_draft, self.length)
        if worth == 0:  # not even one draft pays at this acceptance: plain steps for a while
            self._pause()
        else:
            self.pause_steps = PAUSE_STEPS  # drafting pays again
        return worth

    def observe(self, drafted: int, kept: int) -> None:
        if not drafted:
            return
        self.acceptance = (1 - WEIGHT) * self.acceptance + WEIGHT * kept / drafted
        self.length = min(self.most, self.length + 1) if kept == drafted else max(1, kept + 1)
        if self.acceptance < PAUSE_BELOW:
            self._pause()
            self.acceptance = PAUSE_BELOW  # one good step after the pause resumes drafting

    def _pause(self) -> None:
        """Plain steps for a while, then one draft to try again. Tries that fail back off: a draft
        model catches up on every token it skipped when it drafts again."""
        self.paused, self.length, self.probe = self.pause_steps, 1, True
        self.pause_steps = min(MAX_PAUSE_STEPS, 2 * self.pause_steps)


class StepCosts:
    """What a drafted token costs, in plain decode steps, from the decoder's own step times.

    `began(now)` marks each step once the tokens of the step before are known (that step is then
    finished, mlx-lm's pipelined plain steps included) and before the new one drafts; `chose(k)`
    says how many tokens per row it drafted. The time between two marks is one step's whole cost:
    its drafting, its forward and the engine's bookkeeping. Plain steps give a running mean; a step
    that drafted k tokens gives (its time / plain - 1) / k: `per_draft`.

    A plain interval far beyond the mean is an idle gap or another request's long prefill, and is
    left out. Where every row drafts, `wants_plain` asks for one plain step now and then to price
    against. Where a drafted token costs a whole plain step or more, no acceptance pays: every row
    stops, and drafting is tried again after `retry` steps, twice as many each time it still
    does not pay, and never before the plain steps since took RETRY_COST times what the failed
    try took (a draft model's try catches up on every token it skipped: a prompt's prefill)."""

    WARMUP_PLAIN = 2
    REFRESH_STEPS = 256  # drafting steps between two plain ones
    WEIGHT = 0.25
    GAP = 4.0  # a plain interval over this many plain steps is not a step's cost
    MOST_PER_DRAFT = 8.0  # one odd interval moves the mean by at most WEIGHT times this
    FIRST_RETRY, LAST_RETRY = 64, 4096
    RETRY_COST = 20.0  # failed tries cost at most about 1/RETRY_COST of the time

    def __init__(self, fixed: float | None = None):
        """fixed: a given per_draft, never measured (`draft_cost` in --speculative-config)."""
        self.fixed = fixed
        self.plain_s: float | None = None
        self.per_draft: float | None = fixed
        self.retry = self.FIRST_RETRY
        self._plain_samples = 0
        self._since_plain = 0
        self._stopped_for = 0
        self._stopped_s = 0.0
        self._failed_try_s = 0.0
        self._step: tuple[float, int] | None = None  # (mark, drafts per row) of the step under way

    def began(self, now: float) -> None:
        """A step begins now, which ends the one before it."""
        if self.fixed is not None:
            return
        if self._step is not None:
            start, drafted = self._step
            self._observe(drafted, now - start)
            if self.per_draft is not None and self.per_draft >= 1.0:
                self._stopped_for += 1
                self._stopped_s += now - start
                if (
                    self._stopped_for >= self.retry
                    and self._stopped_s >= self.RETRY_COST * self._failed_try_s
                ):
                    self.per_draft, self._stopped_for, self._stopped_s = None, 0, 0.0  # price it again
                    self.retry = min(self.LAST_RETRY, 2 * self.retry)
        self._step = (now, 0)

    def chose(self, drafted: int) -> None:
        """The step that began drafted up to `drafted` tokens per row (0: a plain step)."""
        if self._step is not None:
            self._step = (self._step[0], drafted)

    def idle(self) -> None:
        """No step follows at once (the batch emptied): the next mark ends nothing."""
        self._step = None

    def wants_plain(self) -> bool:
        if self.fixed is not None:
            return False
        return self._plain_samples < self.WARMUP_PLAIN or self._since_plain >= self.REFRESH_STEPS

    def _observe(self, drafted: int, seconds: float) -> None:
        if not drafted:
            if self.plain_s is not None and seconds > self.GAP * self.plain_s:
                return
            self.plain_s = _mean(self.plain_s, seconds, self.WEIGHT)
            self._plain_samples += 1
            self._since_plain = 0
            return
        self._since_plain += 1
        if self.plain_s is None or self._plain_samples < self.WARMUP_PLAIN:
            return
        extra = min(self.MOST_PER_DRAFT, max(0.0, (seconds / self.plain_s - 1.0) / drafted))
        was_dear = self.per_draft is None or self.per_draft >= 1.0
        self.per_draft = extra if self.per_draft is None else _mean(self.per_draft, extra, self.WEIGHT)
        if self.per_draft >= 1.0:
            self._failed_try_s = seconds
        elif was_dear:
            self.retry = self.FIRST_RETRY  # drafting pays here again


def _mean(mean: float | None, value: float, weight: float) -> float:
    return value if mean is None else (1 - weight) * mean + weight * value
