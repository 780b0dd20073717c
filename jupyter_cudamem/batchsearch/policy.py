"""Choose the next batch size to try, so that few reruns land near the largest batch that fits.

``next()`` gives the batch to try (``None`` once the search has ended, ``stopped`` then says why), the
caller runs it and ``record(batch, observation)`` says what happened. The choice is ``RULES``: an ordered
list of named rules, the first that chooses decides, and ``rule`` names it. What each rule does and what
measured it is in ``docs/oomfix.md`` ("How the search chooses"). The predictions come from ``Tries``:
the allocator's replay of the recorded tries where there is one, else the line through the measured
peaks, each bounded by the least growth the failures show.

Pure arithmetic: no torch, no IPython. Sizes in bytes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

from ..growth import Growth, lowest_slope
from ..growth.fitting import REPLAY_MARGIN
from ..units import MiB

from .state import Attempt, Observation, Tries

FIRST_PROBE_DIVISOR = 64
"""The first probe is the failed batch over 64 (times budget/need where the failure shows the need beyond
the budget): it fits for every start the goal covers, up to 64x the largest batch that fits."""

AGAIN_PROBE_DIVISOR = 8
"""A failed probe shows a start more than 64x too big: the next is 8x lower (starts up to 512x), not 64x,
which would leave a probe so small that its peak is mostly the allocator's rounding."""

JITTER = 0.005
"""How much two runs of a step at one batch differ (another cuDNN or cuBLAS algorithm): a batch that fits
with this much to spare, but not with the margin, "fits but for the margin"."""

MARGIN = 0.04
"""The share of the room above the fixed part that a batch predicted by the line leaves unused: jitter,
blocks and fragments take a few percent of the room the batch's tensors use; weights do not vary."""

BISECT_AFTER_CONTRADICTIONS = 2
"""Tries that failed where the line said they fit, after which the peak is taken as no line."""

BELOW_A_REPLAYED_FAILURE = 5 * REPLAY_MARGIN
"""How far below a batch the replay said fits, and which failed, the next try is at least: the replay saw
every request, so it was close in bytes."""


_REPLAY_ALLOWANCE = f" with its per-sample requests {REPLAY_MARGIN:.0%} larger (the replay's allowance for the next run)"
"""What a replay's prediction allows for, in a try's reason: not ``OomFix.margin``, which leaves a share of the
room unused where the line predicts."""


class Choice(NamedTuple):
    """A batch to try, why, and the peak the line predicts for it (``None``: no prediction)."""

    batch: int
    reason: str
    predicted_peak: float | None


@dataclass
class BatchSearch(Tries):
    """The policy for one failed batch, over what its tries showed (``Tries``). ``max_tries`` bounds the
    reruns."""

    max_tries: int = 3
    margin: float = MARGIN
    stopped: str | None = None
    reason: str = ""  # why the batch ``next()`` returned last was chosen
    rule: str = ""  # the name of the rule that chose it
    _contradictions: int = 0
    _pending: Choice | None = None
    _chosen_by_replay: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_tries < 1:
            raise ValueError("max_tries must be at least 1")

    # -- the protocol -------------------------------------------------------------------------------
    def next(self) -> int | None:
        """The batch to try next; ``None`` once the search has ended (``stopped`` says why)."""
        if self.stopped is not None:
            return None
        choice = self._choose()
        if choice is None:
            return None
        self._pending = choice
        self.reason = choice.reason
        return choice.batch

    def record(self, batch: int, observation: Observation | bool, peak_bytes: int | None = None) -> Attempt:
        """Record what a try of ``batch`` showed (``True``/``False`` with ``peak_bytes`` is short for an
        ``Observation``)."""
        if isinstance(observation, bool):
            observation = Observation(observation, peak_bytes if observation else None,
                                      held_bytes=None if observation else peak_bytes)
        pending = self._pending if self._pending is not None and self._pending.batch == batch else None
        self._pending = None
        reason = pending.reason if pending is not None else "chosen by the caller"
        predicted = pending.predicted_peak if pending is not None else None
        if not observation.fitted and pending is not None and self._chosen_by_replay:
            # The replay said it fits: what PyTorch held reserved but could not use when it failed (or, where
            # it held none, the allocation that failed) is what the replay did not see; the next replay
            # plays under a cap lower by that much.
            held = observation.held_bytes or 0
            missed = observation.stuck_bytes or max((observation.need_bytes or held) - held, 0)
            self._replay_cut_bytes = max(self._replay_cut_bytes, missed)
        if not observation.fitted and self._failed_on_fragments(observation.need_bytes, observation.stuck_bytes):
            # Not the line's error: the fragments are pieces of the try's own tensors, so per sample of
            # its batch they steepen the line, as the failed cell's do.
            self._stuck_per_sample = max(self._stuck_per_sample, float(observation.stuck_bytes or 0) / batch)
            self._contradictions += 1
        elif not observation.fitted and predicted is not None:
            self._contradicted(predicted, observation)
        if observation.recorded is not None:
            # Where its run began: the values the cell binds again, and what the put-back held until its step.
            observation = replace(observation, recorded=replace(observation.recorded, remade=self._remade,
                                                                 released=self._released))
        attempt = Attempt(batch, observation, reason)
        self.attempts.append(attempt)
        return attempt

    def stop(self, reason: str) -> None:
        """End the search (the caller's reason: an error that is not an OOM, a change that cannot be made)."""
        if self.stopped is None:
            self.stopped = reason

    # -- the policy ---------------------------------------------------------------------------------
    def _choose(self) -> Choice | None:
        if len(self.attempts) >= self.max_tries:
            self.stop(f"the {self.max_tries} tries allowed are spent")
            return None
        low, high = self.best or 0, self.smallest_failed
        if high - low <= 1:
            self.stop(f"{low} fits and {high} does not" if low else "no smaller batch is left to try")
            return None
        known = Known(self, low, high, self.growth())
        for rule in RULES:
            choice = rule(known)
            if choice is not None:
                self.rule = rule.__name__
                # Between the largest that fitted and the smallest that failed, of which there is one.
                return choice._replace(batch=min(max(choice.batch, low + 1), high - 1))
        self.stop(f"{known.how}: {low}, which fitted, is the largest batch predicted to fit")
        return None

    def _last_try(self) -> bool:
        return len(self.attempts) == self.max_tries - 1

    def _target(self, growth: Growth, margin: float) -> float:
        """The peak a batch may reach: the usable budget less ``margin`` of the room above the fixed part
        (where the batch's tensors go, and what varies between runs; weights do not)."""
        fixed = min(growth.fixed_bytes, self.usable_bytes)
        return fixed + (self.usable_bytes - fixed) * (1 - margin)

    def _nominal_largest(self, growth: Growth, high: int, margin: float = JITTER) -> int:
        """The largest batch below ``high`` that fits with only ``margin`` (by default what runs at one
        batch differ by): by the replay, or by the line with its steepest slope."""
        if self._chosen_by_replay:
            plain = self.replayed(margin)
            if plain is not None:
                return plain.largest(high - 1)
        return min(growth.largest_batch(self._target(growth, margin), sure=True), high - 1)

    def _halving_candidates(self, low: int, high: int) -> list[int]:
        """The batches halving from the failed one tries (half, a quarter...) between ``low`` and ``high``,
        largest first."""
        found, batch = [], self.failed_batch // 2
        while batch > low:
            if batch < high:
                found.append(batch)
            batch //= 2
        return found

    def _predicted(self, growth: Growth) -> tuple[int, str]:
        """The largest batch predicted to fit with the margins, and how: by the allocator's replay of the
        tries where they were recorded (it sees every phase of a run and what the allocator cannot use),
        else by the line; either way bounded by the least growth the failures show."""
        replayed = self.replayed_batch(REPLAY_MARGIN)
        self._chosen_by_replay = replayed is not None
        if replayed is not None:
            predicted = replayed
            how = f"the allocator's replay of the tries fits up to {replayed}{_REPLAY_ALLOWANCE}"
            paired = self.paired_failure()
            if paired is not None:
                how = (f"the allocator's replay of the tries, with the requests of the one that failed at "
                       f"{paired.batch} up to its failure, fits up to {replayed}{_REPLAY_ALLOWANCE}")
            if self._replay_cut_bytes and paired is None:
                # A batch the replay said fits did not: the replay under the cap less what that run could not
                # use is one bound, the failure less BELOW_A_REPLAYED_FAILURE another; the larger is tried.
                near = int(self.smallest_failed * (1 - BELOW_A_REPLAYED_FAILURE))
                if near > predicted:
                    predicted = near
                    how = f"{self.smallest_failed}, which the allocator's replay said fits, failed: {near} is 10% below it"
        else:
            predicted = growth.largest_batch(self._target(growth, self.margin), sure=True)
            if self._one_batch_measured():
                held = "its parameters" if self.fixed is not None and self.fixed.surely_held_bytes else "zero"
                how = f"surest from {growth.anchor[0]}'s peak (line through it and {held})"
            else:
                how = (f"line through measured peaks: {growth.fixed_bytes / MiB:.0f} MiB fixed + "
                       f"{growth.per_sample_bytes / MiB:.3f} MiB per sample")
        bound = self._failures_bound(growth)
        # A replay is bounded so only where it fits a batch that failed (a replay, one more pass, asked last).
        if bound is not None and bound < predicted and (not self._chosen_by_replay or self._replay_fits_a_failure()):
            predicted = bound
            if self._chosen_by_replay:
                how += f"; the least growth the failures show reaches the budget at {bound}"
        return predicted, how

    def _replay_fits_a_failure(self) -> bool:
        """Whether the replay, with no margin, fits the smallest batch that failed: it missed what grows."""
        exact = self.replayed(0.0)
        return exact is not None and exact.fits(self.smallest_failed)

    def _failures_bound(self, growth: Growth) -> int | None:
        """The batch at which the least growth the failures show (``growth.lowest_slope``, from what fitted
        to what a failure needed at least) reaches the budget: a one-run replay scales every request with
        the batch, and misses a tensor of every sample against every other (a contrastive loss's logits)."""
        slowest = lowest_slope(self._fitted_points(), self._failed_points())
        if slowest <= 0:
            return None
        anchor_batch, anchor_peak = growth.anchor
        return int(math.floor(anchor_batch + (self.usable_bytes - anchor_peak) / slowest))

    def _contradicted(self, predicted_peak: float, observation: Observation) -> None:
        """A try failed where the line said it fits: the usable budget lies between what it held (usable
        for certain) and what failed, and becomes their midpoint, a bisection in bytes that never lands
        above a failure. One that held all the line gave it and wanted more shows the peak is no line."""
        self._contradictions += 1
        held = observation.held_bytes
        if held is not None and held >= predicted_peak * (1 - self.margin):
            self._contradictions = max(self._contradictions, BISECT_AFTER_CONTRADICTIONS)
            return
        failed_at = min(predicted_peak, self.usable_bytes)
        if observation.need_bytes is not None:
            failed_at = min(failed_at, float(observation.need_bytes))
        floor = float(held) if held is not None else failed_at * (1 - 4 * self.margin)
        estimate = (floor + failed_at) / 2
        self._usable_bytes = min(self.usable_bytes, estimate)


class Known:
    """What the rules read for one choice: the largest batch that fitted (``low``), the smallest that
    failed (``high``), the memory model, and the predictions, each computed once and only when a rule asks
    (a replay costs passes over the tries' events)."""

    def __init__(self, search: BatchSearch, low: int, high: int, growth: Growth | None) -> None:
        self.search, self.low, self.high, self.growth = search, low, high, growth

    @property
    def line(self) -> Growth:
        """The memory model, for the rules after the probe's (which choose wherever none was measured)."""
        assert self.growth is not None
        return self.growth

    @functools.cached_property
    def _prediction(self) -> tuple[int, str]:
        predicted, how = self.search._predicted(self.line)
        return min(predicted, self.high - 1), how

    @property
    def predicted(self) -> int:
        """The largest batch predicted to fit with the margins."""
        return self._prediction[0]

    @property
    def how(self) -> str:
        """How that was predicted (the start of each predicted choice's reason)."""
        return self._prediction[1]

    @functools.cached_property
    def nominal_largest(self) -> int:
        """The largest batch that fits but for the margin (``JITTER``)."""
        return self.search._nominal_largest(self.line, self.high)

    @functools.cached_property
    def exact_largest(self) -> int:
        """The largest batch that fits with no margin at all."""
        return self.search._nominal_largest(self.line, self.high, 0.0)

    def halving(self) -> list[int]:
        """Halving's batches between the predicted batch (or what fitted) and the smallest failure."""
        return self.search._halving_candidates(max(self.low, self.predicted), self.high)

    def choice(self, batch: int, reason: str) -> Choice:
        return Choice(batch, reason, self.line.peak_high(batch))


# -- the rules, in order: each returns a choice or None (the next rule decides) ---------------------------
def probe(known: Known) -> Choice | None:
    """Nothing measured yet: try the failed batch over ``FIRST_PROBE_DIVISOR`` (``AGAIN_PROBE_DIVISOR``
    after a failed probe), scaled by budget over need. A failure's need says only "more than the budget",
    so the probe must fit at any start the goal covers."""
    search = known.search
    if known.growth is not None or known.low:
        return None
    failed_tries = sum(1 for a in search.attempts if not a.fitted)
    divisor = FIRST_PROBE_DIVISOR if failed_tries == 0 else AGAIN_PROBE_DIVISOR
    need = search._need_at(known.high)
    scale = min(1.0, search.budget_bytes / need) if need else 1.0
    batch = max(int(known.high * scale / divisor), 1)
    return Choice(batch, f"probe: the failed {known.high} / {divisor / scale:.0f}", None)


def bisect_without_a_peak(known: Known) -> Choice | None:
    """A try fitted but its peak was not measured: nothing to predict from, so bisect."""
    if known.growth is not None:
        return None
    return Choice((known.low + known.high) // 2, "bisection (no peak measured)", None)


def bisect_when_contradicted(known: Known) -> Choice | None:
    """Tries failed ``BISECT_AFTER_CONTRADICTIONS`` times where the line said they fit (and no failed try's
    own requests explain it): the peak is not a line, so bisect."""
    search = known.search
    if search._contradictions < BISECT_AFTER_CONTRADICTIONS or search.paired_failure() is not None:
        return None
    return Choice((known.low + known.high) // 2, "bisection (the line was contradicted twice)", None)


def halving_with_no_margin_on_the_last_rerun(known: Known) -> Choice | None:
    """On the last rerun, a batch of halving's that fits with no margin at all: a failed batch near a power
    of two times the largest lets halving land within the margin of it. By the line (no bound) only where
    what fitted is at least halving's next batch below it."""
    search = known.search
    if not search._last_try():
        return None
    for batch in known.halving():
        if (search._chosen_by_replay or 2 * known.low >= batch) and known.exact_largest >= batch:
            return known.choice(batch, f"{known.how}; {batch}, halving's, fits with no margin")
    return None


def halving_but_for_the_margin(known: Known) -> Choice | None:
    """While reruns are left, a batch of halving's that fits but for the margin (with ``JITTER``): fitting
    it, the search ends on no less than halving would."""
    if known.search._last_try():
        return None
    for batch in known.halving():
        if known.nominal_largest >= batch:
            return known.choice(batch, f"{known.how}; {batch}, halving's, fits but for the margin")
    return None


def largest_predicted(known: Known) -> Choice | None:
    """The largest batch predicted to fit with the margins (``MARGIN``, ``REPLAY_MARGIN``), where it is
    above what fitted."""
    if known.predicted <= known.low:
        return None
    return known.choice(known.predicted, known.how)


def largest_but_for_the_margin(known: Known) -> Choice | None:
    """No larger batch fits with the margin: the largest that fits but for it (``JITTER``). A gain of one
    sample is a gain."""
    if known.nominal_largest < known.low + 1:
        return None
    largest = known.nominal_largest
    return known.choice(largest, f"{known.how}; {largest} fits but for the margin, and a rerun is left")


def halving_next_untried(known: Known) -> Choice | None:
    """Halving's next batch above what fitted is untried: a rerun of it ends on no less than halving does,
    fitted or not. Not on the last rerun, whose failure the driver answers by rerunning the best batch."""
    untried = min(known.search._halving_candidates(known.low, known.high), default=None)
    if untried is None or 2 * known.low < untried or known.search._last_try():
        return None
    return known.choice(untried, f"{known.how}; {untried}, halving's next batch, is untried")


def one_more_sample(known: Known) -> Choice | None:
    """One run bounds the growth from above only, and its peak left room by the margin: one more sample
    says more, and gives a second run to measure the growth from."""
    search, line = known.search, known.line
    if not search._one_batch_measured() or line.anchor[1] >= search._target(line, search.margin):
        return None
    return known.choice(known.low + 1, f"{known.how}; {known.low + 1}, one more sample, while reruns are left")


RULES: tuple[Callable[[Known], Choice | None], ...] = (
    probe, bisect_without_a_peak, bisect_when_contradicted, halving_with_no_margin_on_the_last_rerun,
    halving_but_for_the_margin, largest_predicted, largest_but_for_the_margin, halving_next_untried,
    one_more_sample,
)
"""The search's rules, in the order they decide."""
