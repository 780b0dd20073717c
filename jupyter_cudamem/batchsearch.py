"""Choosing the next batch size to try after a CUDA OOM: ``%oomfix``'s batch search. No torch, no IPython.

``BatchSearch.next()`` gives the batch to try (``None``: the search ended, ``stopped`` says why), the caller
runs it and says what happened (``record``). ``Tries`` holds what the tries showed and what follows: the line
through their peaks (``growth``) and the allocator's replay of their runs (``replayed``). ``RULES`` choose, in
order; each rule's reason and what measured it: ``docs/oomfix.md``, "How the search chooses". Sizes in bytes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from .growth import FixedMemory, Growth, batch_independent_requests, fit, fitting, lowest_slope, replay, through_fixed
from .growth.line import made_in_steps
from .growth.replay import RecordedRun
from .units import MiB

_Pairing = Callable[[int, float], fitting.Fitting]  # whether a batch fits, by cap and margin


@dataclass(frozen=True)
class Observation:
    """What one try showed: for a fit its peak; for an OOM the least it needed (held plus asked), what it
    held, and what PyTorch held reserved but could not use (``stuck_bytes``, from the message). Bytes above
    what was allocated when the reruns began, as is ``start_bytes``, where the try started."""

    fitted: bool
    peak_bytes: int | None = None
    need_bytes: int | None = None
    held_bytes: int | None = None
    start_bytes: int = 0
    stuck_bytes: int | None = None
    recorded: RecordedRun | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class Attempt:
    """One try: the batch, what it showed, and why it was chosen."""

    batch: int
    observation: Observation
    reason: str

    @property
    def fitted(self) -> bool:
        return self.observation.fitted


@dataclass
class Tries:
    """What one search knows: ``failed_batch`` (not a try), the ``budget_bytes`` the cell may use above what
    is allocated as it starts, the failure's ``need_bytes`` and ``stuck_bytes`` (as ``Observation``'s), and
    ``fixed``, what does not grow with the batch, read from the namespace."""

    failed_batch: int
    budget_bytes: int
    need_bytes: int | None = None
    stuck_bytes: int | None = None
    fixed: FixedMemory | None = None
    attempts: list[Attempt] = field(default_factory=list)
    level_bytes: int = 0  # allocated above the reference now, where the next try starts (``set_level``)
    _usable_bytes: float | None = None  # the budget, lowered when a try fails where the line said it fits
    _segments: tuple[replay.StartSegment, ...] | None = None  # where the next try starts (``set_allocator``)
    _reserved_limit: int | None = None
    _remade: tuple[frozenset[int], ...] = ()  # addresses of what the cell binds again (``set_allocator``)
    _released: frozenset[int] = frozenset()  # addresses held until the next try's first step (``set_allocator``)
    _replay_cut_bytes: int = 0  # what a try the replay said fits showed it cannot use
    _paired_for: tuple[tuple[object, ...], Attempt | None] | None = None  # ``paired_failure``'s, and for what
    _paired_runs: tuple[tuple[object, ...], _Pairing | None] | None = None  # ``_paired``'s: the runs, their pairing

    def __post_init__(self) -> None:
        if self.failed_batch < 2:
            raise ValueError(f"a batch of {self.failed_batch} cannot be made smaller")
        # The failed cell's fragments per sample: pieces of the batch's own tensors.
        fragments = self._failed_on_fragments(self.need_bytes, self.stuck_bytes)
        self._stuck_per_sample = float(self.stuck_bytes or 0) / self.failed_batch if fragments else 0.0

    def _failed_on_fragments(self, need: int | None, stuck: int | None) -> bool:
        """The failure's bytes fit the budget, and PyTorch held some it could not use: fragments decided it."""
        return bool(stuck) and need is not None and need <= self.budget_bytes

    @property
    def best(self) -> int | None:
        """The largest batch that fitted."""
        return max((a.batch for a in self.attempts if a.fitted), default=None)

    @property
    def answer(self) -> int | None:
        """The largest batch that fitted, as ``kept`` judges it (a try proves one run)."""
        return None if self.best is None else self.kept(self.best)

    def kept(self, batch: int) -> int:
        """``batch`` where its recorded run, replayed as the next runs make it, keeps fitting (or cannot be
        judged); else the larger of the largest below it that its requests keep fitting (``fitting_from_one``)
        and the largest other try below it whose own run keeps fitting."""
        runs, cap = self._recorded_fits(), self._reserved_limit
        run = runs.get(batch)
        if run is None or not run.whole or cap is None or fitting.keeps_fitting(run, cap):
            return batch
        scaled = fitting.fitting_from_one(run.events_from(run.start, run.remade, run.released), batch,
                                          run.start, cap, batch_independent=self._one_run_fixed(run),
                                          released=run.released_keys)
        held = [other_batch for other_batch, other in runs.items()
                if other_batch < batch and fitting.keeps_fitting(other, cap)]
        return max([scaled.largest(batch - 1) if scaled is not None else 0, *held])

    @property
    def smallest_failed(self) -> int:
        return min([self.failed_batch] + [a.batch for a in self.attempts if not a.fitted])

    @property
    def usable_bytes(self) -> float:
        """The budget, lowered by tries that failed where the line said they fit."""
        return float(self.budget_bytes) if self._usable_bytes is None else self._usable_bytes

    def _fitted_points(self) -> list[tuple[int, float]]:
        return [(a.batch, float(a.observation.peak_bytes)) for a in self.attempts
                if a.fitted and a.observation.peak_bytes is not None]

    def _failed_points(self) -> list[tuple[int, float]]:
        points = [(a.batch, float(a.observation.need_bytes)) for a in self.attempts
                  if not a.fitted and a.observation.need_bytes is not None]
        if self.need_bytes is not None:
            points.append((self.failed_batch, float(self.need_bytes)))
        return points

    def set_level(self, level_bytes: int) -> None:
        """Where the next try starts, above the reference: what earlier tries left, in every later peak."""
        self.level_bytes = level_bytes

    def set_allocator(self, segments: tuple[replay.StartSegment, ...] | None, reserved_limit_bytes: int | None,
                      remade: tuple[frozenset[int], ...] = (), released: frozenset[int] = frozenset()) -> None:
        """The segments the next try starts from and the reserved bytes it may reach (``None``: no replay), with
        ``remade`` and ``released`` as ``RecordedRun.events_from`` reads them."""
        self._segments, self._reserved_limit = segments, reserved_limit_bytes
        self._remade, self._released = remade, released

    def replayed(self, margin: float = 0.0) -> fitting.Fitting | None:
        """Whether a batch fits, by the replay of the two largest recorded fits (the largest alone where one
        is a window of a long run, or with a failure above it: ``paired_failure``), from where the next try
        starts, under the cap less what a failed try showed the replay misses; per-sample parts ``1 + margin``
        times as large. ``None`` without a replay."""
        runs, segments = self._recorded_fits(), self._segments
        if segments is None or self._reserved_limit is None or not runs:
            return None
        cap, batches = self._reserved_limit - self._replay_cut_bytes, sorted(runs)
        if len(batches) == 1 or not all(runs[b].whole for b in batches[-2:]):
            # A window begins elsewhere in the cell's loop than a whole run: it cannot be paired with one.
            paired = self._with_failure(self.paired_failure(), margin)
            if paired is not None:
                return paired
            run = runs[batches[-1]]
            return fitting.fitting_from_one(self._events_from(run), batches[-1], segments, cap, margin=margin,
                                           batch_independent=self._one_run_fixed(run), released=self._released_keys())
        low, high = batches[-2], batches[-1]
        under = self._paired((runs[low], runs[high], segments), lambda: fitting.paired_fittings(
            self._events_from(runs[low]), low, self._events_from(runs[high]), high, segments, self._released_keys(),
            self._one_run_fixed(runs[high])))
        return None if under is None else under(cap, margin)

    def _paired(self, runs: tuple[object, ...], pair: Callable[[], _Pairing | None]) -> _Pairing | None:
        """``pair()``, kept while the same recorded runs and segments (``runs``, by identity) are asked for."""
        if self._paired_runs is None or any(a is not b for a, b in zip(self._paired_runs[0], runs)):
            self._paired_runs = (runs, pair())
        return self._paired_runs[1]

    def paired_failure(self) -> Attempt | None:
        """The recorded failure just above the one recorded fit, where their paired replay
        (``fitting.paired_with_failure``) fails at its batch as it did: one that fits there missed what made
        the try fail (fragments, a larger workspace), and is no better than the one run's replay."""
        known = (len(self.attempts), self._segments, self._reserved_limit)
        if self._paired_for is not None and self._paired_for[0] == known:
            return self._paired_for[1]
        failure = self._failed_recording()
        exact = self._with_failure(failure, 0.0)
        paired = failure if exact is not None and failure is not None and not exact.fits(failure.batch) else None
        self._paired_for = (known, paired)
        return paired

    def _with_failure(self, failure: Attempt | None, margin: float) -> fitting.Fitting | None:
        """The replay of the one recorded run that fitted with ``failure``'s requests up to the one that raised."""
        runs = self._recorded_fits()
        if failure is None or len(runs) != 1 or failure.observation.recorded is None:
            return None
        (batch, run), = runs.items()
        if not run.whole or self._segments is None or self._reserved_limit is None:
            return None
        segments, failed = self._segments, failure.observation.recorded
        under = self._paired((run, failed, segments), lambda: fitting.paired_with_failure(
            self._events_from(run), batch, failed.events, failure.batch, segments,
            batch_independent=self._one_run_fixed(run), released=self._released_keys()))
        return None if under is None else under(self._reserved_limit, margin)

    def _events_from(self, run: RecordedRun) -> list[replay.Event]:
        """``run``'s events as the next try makes them, from where it starts."""
        return run.events_from(self._segments or (), self._remade, self._released)

    def _released_keys(self) -> frozenset[int]:
        return replay.keys_at(self._segments or (), self._released)

    def _recorded_fits(self) -> dict[int, RecordedRun]:
        return {a.batch: a.observation.recorded for a in self.attempts
                if a.fitted and a.observation.recorded is not None}

    def _one_run_fixed(self, run: RecordedRun) -> frozenset[int]:
        """Keys of one run's requests taken as batch-independent: its steps' and ``batch_independent_requests``'s."""
        if self.fixed is None:
            return made_in_steps(run.events, run.steps) | run.carried
        return batch_independent_requests(run.events, {key for _, key in run.left}, self.fixed, run.steps) | run.carried

    def _failed_recording(self) -> Attempt | None:
        """The recorded try that failed at the smallest batch above the best that fitted."""
        failed = [a for a in self.attempts if not a.fitted and a.batch > (self.best or 0)
                  and a.observation.recorded is not None and a.observation.recorded.whole]
        return min(failed, key=lambda a: a.batch, default=None)

    def replayed_batch(self, margin: float = 0.0) -> int | None:
        """The largest batch below the smallest that failed whose replay fits (``replayed``)."""
        found = self.replayed(margin)
        return None if found is None else found.largest(max(self.smallest_failed - 1, 1))

    def growth(self) -> Growth | None:
        """The line the fitted tries give for a try starting at ``level_bytes`` (``None``: none measured): from one
        batch through its peak above its start and what every phase holds (``through_fixed``), from more fitted from
        the reference (erring toward batches that fit); raised by what the next try starts with above the anchor's."""
        fitted = [a for a in self.attempts if a.fitted and a.observation.peak_bytes is not None]
        if not fitted:
            return None
        if self._one_batch_measured():
            top = max(fitted, key=lambda a: a.observation.peak_bytes or 0)
            own = float(top.observation.peak_bytes or 0) - top.observation.start_bytes
            held = 0.0 if self.fixed is None else float(self.fixed.surely_held_bytes)
            growth = through_fixed(top.batch, max(own, 0.0), held).raised(self.level_bytes)
        else:
            line = fit(self._fitted_points())
            if line is None:
                return None
            started = max(a.observation.start_bytes for a in fitted if a.batch == line.anchor[0])
            growth = line.raised(max(self.level_bytes - started, 0))
        return growth.steeper(self._stuck_per_sample)

    def _one_batch_measured(self) -> bool:
        return len({b for b, _ in self._fitted_points()}) == 1


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

BELOW_A_REPLAYED_FAILURE = 5 * fitting.REPLAY_MARGIN
"""How far below a batch the replay said fits, and which failed, the next try is at least: the replay saw
every request, so it was close in bytes."""


_REPLAY_ALLOWANCE = (f" with its per-sample requests {fitting.REPLAY_MARGIN:.0%} larger"  # in a try's reason
                     " (the replay's allowance for the next run)")


class Choice(NamedTuple):
    """A batch to try, why, and the peak the line predicts for it (``None``: no prediction)."""
    batch: int
    reason: str
    predicted_peak: float | None


@dataclass
class BatchSearch(Tries):
    """The policy for one failed batch, over what its tries showed. ``max_tries`` bounds the reruns."""

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

    def next(self) -> int | None:
        """The batch to try next; ``None`` once the search has ended (``stopped`` says why)."""
        choice = self._choose() if self.stopped is None else None
        if choice is None:
            return None
        self._pending, self.reason = choice, choice.reason
        return choice.batch

    def record(self, batch: int, observation: Observation) -> Attempt:
        """Record what a try of ``batch`` showed."""
        pending = self._pending if self._pending is not None and self._pending.batch == batch else None
        self._pending = None
        reason = pending.reason if pending is not None else "chosen by the caller"
        if not observation.fitted and pending is not None and self._chosen_by_replay:
            # The replay said it fits: it missed what PyTorch could not use (where none, the allocation that failed).
            held = observation.held_bytes or 0
            missed = observation.stuck_bytes or max((observation.need_bytes or held) - held, 0)
            self._replay_cut_bytes = max(self._replay_cut_bytes, missed)
        if not observation.fitted and self._failed_on_fragments(observation.need_bytes, observation.stuck_bytes):
            # Not the line's error: fragments of the try's own tensors steepen the line, as the failed cell's do.
            self._stuck_per_sample = max(self._stuck_per_sample, float(observation.stuck_bytes or 0) / batch)
            self._contradictions += 1
        elif not observation.fitted and pending is not None and pending.predicted_peak is not None:
            self._contradicted(pending.predicted_peak, observation)
        if observation.recorded is not None:
            observation = replace(observation, recorded=replace(observation.recorded, remade=self._remade,
                                                                 released=self._released))
        attempt = Attempt(batch, observation, reason)
        self.attempts.append(attempt)
        return attempt

    def stop(self, reason: str) -> None:
        """End the search (the caller's reason: an error that is not an OOM, a change that cannot be made)."""
        if self.stopped is None:
            self.stopped = reason

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
                return choice._replace(batch=min(max(choice.batch, low + 1), high - 1))
        self.stop(f"{known.how}: {low}, which fitted, is the largest batch predicted to fit")
        return None

    def _last_try(self) -> bool:
        return len(self.attempts) == self.max_tries - 1

    def _target(self, growth: Growth, margin: float) -> float:
        """The peak a batch may reach: the usable budget less ``margin`` of the room above the fixed part
        (what varies between runs; weights do not)."""
        fixed = min(growth.fixed_bytes, self.usable_bytes)
        return fixed + (self.usable_bytes - fixed) * (1 - margin)

    def _predicted(self, growth: Growth) -> tuple[int, str]:
        """The largest batch predicted to fit with the margins, and how: by the replay where the tries were
        recorded, else by the line; either way bounded by the least growth the failures show."""
        replayed = self.replayed_batch(fitting.REPLAY_MARGIN)
        self._chosen_by_replay = replayed is not None
        if replayed is not None:
            predicted = replayed
            how = f"the allocator's replay of the tries fits up to {replayed}{_REPLAY_ALLOWANCE}"
            paired = self.paired_failure()
            if paired is not None:
                how = (f"the allocator's replay of the tries, with the requests of the one that failed at "
                       f"{paired.batch} up to its failure, fits up to {replayed}{_REPLAY_ALLOWANCE}")
            elif self._replay_cut_bytes:  # a batch the replay said fits failed
                near = int(self.smallest_failed * (1 - BELOW_A_REPLAYED_FAILURE))
                if near > predicted:
                    predicted = near
                    how = (f"{self.smallest_failed}, which the allocator's replay said fits, failed: "
                           f"{near} is 10% below it")
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
        self._usable_bytes = min(self.usable_bytes, (floor + failed_at) / 2)


class Known:
    """What the rules read for one choice: the largest batch that fitted (``low``), the smallest that failed
    (``high``), the line, and the predictions, each made once and only when a rule asks (replays cost)."""

    def __init__(self, search: BatchSearch, low: int, high: int, growth: Growth | None) -> None:
        self.search, self.low, self.high, self.growth = search, low, high, growth
        # By margin: the replay, asked several times (its bound is kept), and the largest batch it fits.
        self._replays: dict[float, fitting.Fitting | None] = {}
        self._largest_by_margin: dict[float, int] = {}

    @property
    def line(self) -> Growth:
        assert self.growth is not None  # the rules after the probe's, which chooses where none was measured
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
        """How that was predicted (the start of a predicted choice's reason)."""
        return self._prediction[1]

    @property
    def nominal_largest(self) -> int:
        """The largest batch that fits but for the margin (``JITTER``)."""
        return self._largest(JITTER)

    def reaches(self, batch: int, no_margin: bool = False) -> bool:
        """Whether ``nominal_largest`` (with ``no_margin``, the largest that fits with no margin at all) is at
        least ``batch``: a replay stops where it is known below (``Fitting.largest``'s ``at_least``)."""
        return self._largest(0.0 if no_margin else JITTER, at_least=batch) >= batch

    def _largest(self, margin: float, at_least: int = 0) -> int:
        """The largest batch below ``high`` that fits with only ``margin``: by the replay (where below
        ``at_least``, any batch below it), or by the line with its steepest slope."""
        if margin in self._largest_by_margin:
            return self._largest_by_margin[margin]
        if margin not in self._replays:
            self._replays[margin] = self.search.replayed(margin) if self.search._chosen_by_replay else None
        plain = self._replays[margin]
        if plain is None:
            found = min(self.line.largest_batch(self.search._target(self.line, margin), sure=True), self.high - 1)
        else:
            found = plain.largest(self.high - 1, at_least)
        if found >= at_least:  # else a batch below it, where a replay stopped
            self._largest_by_margin[margin] = found
        return found

    def halving(self, above: int | None = None) -> list[int]:
        """Halving's batches from the failed one (half, a quarter...), largest first, below the smallest
        failure and above ``above`` (by default the predicted batch or what fitted)."""
        above = max(self.low, self.predicted) if above is None else above
        found, batch = [], self.search.failed_batch // 2
        while batch > above:
            if batch < self.high:
                found.append(batch)
            batch //= 2
        return found

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
    divisor = AGAIN_PROBE_DIVISOR if any(not a.fitted for a in search.attempts) else FIRST_PROBE_DIVISOR
    need = max((n for b, n in search._failed_points() if b == known.high), default=0.0)
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
        if (search._chosen_by_replay or 2 * known.low >= batch) and known.reaches(batch, no_margin=True):
            return known.choice(batch, f"{known.how}; {batch}, halving's, fits with no margin")
    return None


def halving_but_for_the_margin(known: Known) -> Choice | None:
    """While reruns are left, a batch of halving's that fits but for the margin (with ``JITTER``): fitting
    it, the search ends on no less than halving would."""
    if known.search._last_try():
        return None
    for batch in known.halving():
        if known.reaches(batch):
            return known.choice(batch, f"{known.how}; {batch}, halving's, fits but for the margin")
    return None


def largest_predicted(known: Known) -> Choice | None:
    """The largest batch predicted to fit with the margins (``MARGIN``, ``fitting.REPLAY_MARGIN``) above what fitted."""
    if known.predicted <= known.low:
        return None
    return known.choice(known.predicted, known.how)


def largest_but_for_the_margin(known: Known) -> Choice | None:
    """No larger batch fits with the margin: the largest that fits but for it (``JITTER``). A gain of one
    sample is a gain."""
    if not known.reaches(known.low + 1):
        return None
    largest = known.nominal_largest
    return known.choice(largest, f"{known.how}; {largest} fits but for the margin, and a rerun is left")


def halving_next_untried(known: Known) -> Choice | None:
    """Halving's next batch above what fitted is untried: a rerun of it ends on no less than halving does,
    fitted or not. Not on the last rerun, whose failure the driver answers by rerunning the best batch."""
    untried = min(known.halving(above=known.low), default=None)
    if untried is None or 2 * known.low < untried or known.search._last_try():
        return None
    return known.choice(untried, f"{known.how}; {untried}, halving's next batch, is untried")


def one_more_sample(known: Known) -> Choice | None:
    """One run bounds the growth from above only, and its peak left room by the margin (or two reruns are
    left, so a failure costs one and the last confirms what fitted: one run's replay takes all it cannot
    tell as growing with the batch, and errs small): one more sample says more, and gives a second run to
    measure the growth from."""
    search, line = known.search, known.line
    spare = search.max_tries - len(search.attempts) >= 2
    if not search._one_batch_measured() or (not spare and line.anchor[1] >= search._target(line, search.margin)):
        return None
    return known.choice(known.low + 1, f"{known.how}; {known.low + 1}, one more sample, while reruns are left")


RULES: tuple[Callable[[Known], Choice | None], ...] = (
    probe, bisect_without_a_peak, bisect_when_contradicted, halving_with_no_margin_on_the_last_rerun,
    halving_but_for_the_margin, largest_predicted, largest_but_for_the_margin, halving_next_untried,
    one_more_sample,
)
"""The search's rules, in the order they decide."""
