"""How many tokens a sequence drafts next: as many as pay for themselves at its acceptance and at
what a step that drafts them costs here, fewer while its drafts are rejected, and none for a while
when they keep failing, so text that drafts badly costs about what it costs without drafting.

Worth it: with per-token acceptance a, a step that drafts k tokens yields on average
1 + a + ... + a^k tokens and costs r(k) plain steps (`StepCosts`, measured per draft length from
the engine's own steps). A step's price need not grow in proportion to k: verifying any draft
can cost a fixed part (a synchronous forward where plain steps overlap the next one), so each
length is priced on its own. Where the hop dominates a step (a GPU, a network) r(k) stays near 1
and drafting pays at low acceptance; where a step's cost is its compute (a CPU), or a draft model
costs as much as the served one, only well-accepted drafts pay, or none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

PAUSE_BELOW = 0.2  # mean acceptance under which drafting pauses
PAUSE_STEPS = 16  # steps a paused sequence decodes plainly before it tries again
MAX_PAUSE_STEPS = 1024  # each pause that follows a failed try is twice as long, up to this
WEIGHT = 0.5  # of the newest step in the running acceptance
MARGIN = 1.02  # a gain within noise is not worth a longer step


def worth_drafting(acceptance: float, step_ratio: Callable[[int], float], most: int) -> int:
    """The draft length (0..most) with the most tokens per unit of step cost; step_ratio(k) is
    what a step drafting k tokens costs, in plain steps."""
    best, best_gain, expected = 0, 1.0, 1.0
    for k in range(1, most + 1):
        expected += acceptance**k
        gain = expected / step_ratio(k)
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

    def budget(self, costs: StepCosts | None = None) -> int:
        """Drafts for the next step, at the step prices `costs` holds (None, or nothing priced
        yet: draft the current length, which prices it)."""
        if self.paused:
            self.paused -= 1
            return 0
        if self.probe:  # acceptance is only measured where something is drafted
            self.probe = False
            return 1
        if costs is None or not costs.priced:
            return self.length
        if costs.stopped:  # no acceptance pays for it: StepCosts stops and retries every row
            return 0
        worth = worth_drafting(self.acceptance, costs.ratio, self.length)
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
    """What a step that drafts k tokens per row costs, in plain decode steps, from the decoder's
    own step times: `ratio(k)`.

    `began(now)` marks each step once the tokens of the step before are known (that step is then
    finished, mlx-lm's pipelined plain steps included) and before the new one drafts; `chose(k)`
    says how many tokens per row it drafted. The time between two marks is one step's whole cost:
    its drafting, its forward and the engine's bookkeeping. Plain steps give a running mean; each
    draft length a running mean of its steps' times over that. A length not yet measured is priced
    from those that are, on the dear side: as the next longer one, or past the longest in
    proportion to its draft.

    An interval far beyond its mean is an idle gap, another request's long prefill or a draft
    model catching up on a new prompt, and is left out (a drafting length's, unless the next one at
    that length is too: then the price moved). Where every row drafts, `wants_plain` asks for one
    plain step now and then to price against; it also forgets the lengths no step timed since the
    one before, so a length priced dear once is priced again from its neighbours.

    Where a drafted token costs a whole plain step or more at every length measured, no acceptance
    pays: every row stops (`stopped`), and drafting is priced again after `retry` steps, twice as
    many each time it still does not pay, and never before the plain steps since took RETRY_COST
    times what the failed try took (a draft model's try catches up on every token it skipped: a
    prompt's prefill)."""

    WARMUP_PLAIN = 2
    REFRESH_STEPS = 256  # drafting steps between two plain ones
    WEIGHT = 0.25
    GAP = 4.0  # a plain interval over this many plain steps is not a step's cost
    MOST_PER_DRAFT = 8.0  # one odd interval moves a mean by at most WEIGHT times this per draft
    FIRST_RETRY, LAST_RETRY = 64, 4096
    RETRY_COST = 20.0  # failed tries cost at most about 1/RETRY_COST of the time

    def __init__(self, fixed: float | None = None):
        """fixed: a given price per drafted token, r(k) = 1 + fixed * k, never measured
        (`draft_cost` in --speculative-config)."""
        self.fixed = fixed
        self.plain_s: float | None = None
        self.ratios: dict[int, float] = {}  # drafts per row -> mean step time in plain steps
        self._timed: set[int] = set()  # lengths timed since the last plain step
        self._odd: set[int] = set()  # lengths whose last interval was left out
        self.retry = self.FIRST_RETRY
        self._plain_samples = 0
        self._since_plain = 0
        self._stopped_for = 0
        self._stopped_s = 0.0
        self._failed_try_s = 0.0
        self._step: tuple[float, int] | None = None  # (mark, drafts per row) of the step under way

    @property
    def priced(self) -> bool:
        return self.fixed is not None or bool(self.ratios)

    def ratio(self, drafted: int) -> float:
        """What a step drafting `drafted` tokens per row costs, in plain steps (once `priced`)."""
        if drafted == 0:
            return 1.0
        if self.fixed is not None:
            return 1.0 + self.fixed * drafted
        if drafted in self.ratios:
            return self.ratios[drafted]
        longer = [k for k in self.ratios if k > drafted]
        if longer:  # fewer drafts cost at most what more cost
            return self.ratios[min(longer)]
        longest = max(self.ratios)
        return 1.0 + (self.ratios[longest] - 1.0) * drafted / longest

    @property
    def per_draft(self) -> float | None:
        """The least a drafted token adds to a step over the lengths priced, in plain steps."""
        if self.fixed is not None:
            return self.fixed
        return min(((r - 1.0) / k for k, r in self.ratios.items()), default=None)

    @property
    def stopped(self) -> bool:
        """No draft length pays for itself even if every drafted token is accepted."""
        return self.priced and self.per_draft >= 1.0

    def began(self, now: float) -> None:
        """A step begins now, which ends the one before it."""
        if self.fixed is not None:
            return
        if self._step is not None:
            start, drafted = self._step
            self._observe(drafted, now - start)
            if self.stopped:
                self._stopped_for += 1
                self._stopped_s += now - start
                if (
                    self._stopped_for >= self.retry
                    and self._stopped_s >= self.RETRY_COST * self._failed_try_s
                ):
                    self.ratios.clear()  # price it again
                    self._stopped_for, self._stopped_s = 0, 0.0
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
            if self._since_plain >= self.REFRESH_STEPS:  # lengths not timed since are stale
                self.ratios = {k: r for k, r in self.ratios.items() if k in self._timed}
            self._since_plain = 0
            self._timed.clear()
            return
        self._since_plain += 1
        if self.plain_s is None or self._plain_samples < self.WARMUP_PLAIN:
            return
        ratio = min(1.0 + self.MOST_PER_DRAFT * drafted, max(1.0, seconds / self.plain_s))
        mean = self.ratios.get(drafted)
        if mean is not None and ratio > self.GAP * mean and drafted not in self._odd:
            self._odd.add(drafted)
            return
        self._odd.discard(drafted)
        self._timed.add(drafted)
        was_dear = not self.priced or self.stopped
        self.ratios[drafted] = _mean(self.ratios.get(drafted), ratio, self.WEIGHT)
        if self.stopped:
            self._failed_try_s = seconds
        elif was_dear:
            self.retry = self.FIRST_RETRY  # drafting pays here again


def _mean(mean: float | None, value: float, weight: float) -> float:
    return value if mean is None else (1 - weight) * mean + weight * value
