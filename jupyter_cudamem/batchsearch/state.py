"""What the tries of one batch search showed, and what follows from it: the largest batch that fitted,
the smallest that failed, the budget, the memory model the fitted tries give (``growth``) and the
allocator's replay of their recorded runs (``replayed``). ``policy.BatchSearch`` chooses from it.

Pure arithmetic: no torch, no IPython. Sizes in bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..growth import FixedMemory, Growth, batch_independent_requests, fit, through_fixed
from ..growth import fitting, replay
from ..growth.line import made_in_steps

from ..growth.replay import RecordedRun


@dataclass(frozen=True)
class Observation:
    """What one try showed: whether it fitted; for a fit its peak, for an OOM the least it needed
    (what it held when it failed plus what it asked for), what it held, and what PyTorch held reserved
    but unallocated when it failed (``stuck_bytes``, from the OOM message). All but the last above the
    search's reference level (what was allocated when the reruns began); ``start_bytes`` is how far
    above it the try started (state an earlier try left: gradients, optimizer state)."""

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

    @property
    def peak_bytes(self) -> int | None:
        return self.observation.peak_bytes if self.fitted else self.observation.held_bytes


@dataclass
class Tries:
    """What one search knows. ``failed_batch`` failed first (not counted as a try); ``budget_bytes`` is
    what the cell may use above what is allocated when it starts; ``need_bytes`` the least the failed
    batch needed and ``stuck_bytes`` what PyTorch held reserved but could not use when it failed, both
    from its OOM message (``None`` when unknown); ``fixed`` what does not grow with the batch, read from
    the namespace."""

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
    # ``paired_failure``'s answer, and for which tries, segments and cap
    _paired_for: tuple[tuple[object, ...], Attempt | None] | None = None
    # The recorded runs ``replayed`` last paired (two that fitted, or one and a failure) and the segments they
    # were read from, and the pairing: the search asks at several margins, and pairing long runs costs up to
    # a second each time.
    _paired_runs: tuple[tuple[object, ...], Callable[[int, float], fitting.Fitting] | None] | None = None

    def __post_init__(self) -> None:
        if self.failed_batch < 2:
            raise ValueError(f"a batch of {self.failed_batch} cannot be made smaller")
        # The failed cell's fragments, per sample of its batch: they are pieces of the batch's own tensors.
        self._stuck_per_sample = 0.0
        if self._failed_on_fragments(self.need_bytes, self.stuck_bytes):
            self._stuck_per_sample = float(self.stuck_bytes or 0) / self.failed_batch

    def _failed_on_fragments(self, need: int | None, stuck: int | None) -> bool:
        """The failure's bytes fit the budget, and PyTorch held some it could not use: its fragments
        decided it."""
        return bool(stuck) and need is not None and need <= self.budget_bytes

    @property
    def best(self) -> int | None:
        """The largest batch that fitted."""
        fitted = [a.batch for a in self.attempts if a.fitted]
        return max(fitted) if fitted else None

    @property
    def answer(self) -> int | None:
        """The batch to report: the largest that fitted, unless the replay of its own recorded run, run after
        run as the cell's next runs make it, runs out of memory (a try proves one run; the layout and the
        values it leaves decide the next). Then the larger of the largest batch below it that its own run's
        requests keep fitting (``fitting_from_one``) and the largest other try whose own run keeps fitting."""
        best = self.best
        own = self._own_run(best) if best is not None else None
        if best is None or own is None or self._reserved_limit is None:
            return best
        run, events = own
        if fitting.fits_in_a_row(events, run.start, self._reserved_limit, released=run.released_keys):
            return best
        scaled = fitting.fitting_from_one(events, best, run.start, self._reserved_limit,
                                          batch_independent=self._one_run_fixed(run), released=run.released_keys)
        held = [a.batch for a in self.attempts if a.fitted and a.batch < best and self._own_run_holds(a.batch)]
        return max([scaled.largest(best - 1) if scaled is not None else 0, *held])

    def _own_run(self, batch: int) -> tuple[RecordedRun, list[replay.Event]] | None:
        """The whole recorded run of the try that fitted at ``batch``, and its events from where it began."""
        run = self._recorded_fits().get(batch)
        return None if run is None or not run.whole else (run, run.events_from(run.start, run.remade, run.released))

    def _own_run_holds(self, batch: int) -> bool:
        """Whether the try that fitted at ``batch`` recorded a whole run that fits ``fitting.RUNS_IN_A_ROW``
        times from where it began, under the cap it fitted under."""
        own = self._own_run(batch)
        return (own is not None and self._reserved_limit is not None
                and fitting.fits_in_a_row(own[1], own[0].start, self._reserved_limit,
                                          released=own[0].released_keys))

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
        """Where the next try starts, above the reference level: what earlier tries left that stays
        allocated whatever the batch (it is part of every later peak)."""
        self.level_bytes = level_bytes

    def set_allocator(self, segments: tuple[replay.StartSegment, ...] | None, reserved_limit_bytes: int | None,
                      remade: tuple[frozenset[int], ...] = (), released: frozenset[int] = frozenset()) -> None:
        """The allocator's segments where the next try starts, and the reserved bytes it may reach:
        what the replay plays from and under (``None``: no replay). ``remade``: the addresses in them of
        each value the cell binds again, name by name, which its run makes anew (``replay.rebound_keys``);
        ``released``: of what the put-back holds until the try's first step (``replay.with_released``)."""
        self._segments, self._reserved_limit, self._remade = segments, reserved_limit_bytes, remade
        self._released = released

    def replayed(self, margin: float = 0.0) -> fitting.Fitting | None:
        """Whether a batch fits, by the allocator's replay of the two largest recorded tries that fitted (of
        the largest, where only one did or one of the two is a window of a long run, with the beginning of
        a try that failed above it where that replays its failure: ``paired_failure``), from the segments
        the next try starts with, under the cap less what a failed try showed the replay does not see
        (not where the failed try's own requests are replayed); each request's per-sample part taken
        ``1 + margin`` times as large. ``None`` without a replay."""
        if self._segments is None or self._reserved_limit is None:
            return None
        runs = self._recorded_fits()
        if not runs:
            return None
        batches = sorted(runs)
        if len(batches) == 1 or not all(runs[b].whole for b in batches[-2:]):
            # One run; or a window of a long run among the two, which begins elsewhere in the cell's loop
            # than the other's and cannot be paired with it request by request: the larger alone.
            failure = self.paired_failure()
            paired = self._with_failure(failure, margin) if failure is not None else None
            if paired is not None:
                return paired
            run = runs[batches[-1]]
            return fitting.fitting_from_one(self._events_from(run), batches[-1], self._segments,
                                           self._reserved_limit - self._replay_cut_bytes,
                                           batch_independent=self._one_run_fixed(run), margin=margin,
                                           released=self._released_keys())
        low, high = batches[-2], batches[-1]
        segments = self._segments
        under = self._paired((runs[low], runs[high], segments), lambda: fitting.paired_fittings(
            self._events_from(runs[low]), low, self._events_from(runs[high]), high, segments, self._released_keys()))
        return None if under is None else under(self._reserved_limit - self._replay_cut_bytes, margin)

    def _paired(self, runs: tuple[object, ...],
                pair: Callable[[], Callable[[int, float], fitting.Fitting] | None]
                ) -> Callable[[int, float], fitting.Fitting] | None:
        """``pair()``, kept while the same recorded runs and segments (``runs``, by identity) are asked for."""
        if self._paired_runs is None or any(a is not b for a, b in zip(self._paired_runs[0], runs)):
            self._paired_runs = (runs, pair())
        return self._paired_runs[1]

    def paired_failure(self) -> Attempt | None:
        """The recorded try that failed at the smallest batch above the one recorded run that fitted, where
        the replay pairs the two (``growth.fitting.paired_with_failure``): only where that replay,
        with no margin, fails at the failed try's batch, as the try did. Where it fits there, what made the
        try fail (fragments a request of another size leaves, a workspace drawn larger) is not in it, and
        it is no better than the one run's replay under the cap less what the try could not use."""
        known = (len(self.attempts), self._segments, self._reserved_limit)
        if self._paired_for is not None and self._paired_for[0] == known:
            return self._paired_for[1]
        failure = self._failed_recording()
        exact = self._with_failure(failure, 0.0) if failure is not None else None
        paired = failure if exact is not None and failure is not None and not exact.fits(failure.batch) else None
        self._paired_for = (known, paired)
        return paired

    def _with_failure(self, failure: Attempt, margin: float) -> fitting.Fitting | None:
        """The replay of the one recorded run that fitted with ``failure``'s requests up to the one that raised."""
        runs = self._recorded_fits()
        if len(runs) != 1 or failure.observation.recorded is None:
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
        """The keys of one recorded run's requests taken as batch-independent: what its optimizer steps made,
        and what ``batch_independent_requests`` reads from sizes and lifetimes."""
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
        """The memory model the fitted tries give (``None`` before any fit was measured), for a try
        starting at ``level_bytes``.

        One point bounds the slope by its peak above its own start over its batch (the batch-independent
        part of that peak is never negative), on top of what the next try starts with. Two or more are
        fitted as measured from the reference: a state an earlier try created after its peak (Adam's
        moments, made in ``step()``) then steepens the line, which errs toward batches that fit. The
        anchor is raised by whatever more the next try starts with than the anchor's try did."""
        fitted = [a for a in self.attempts if a.fitted and a.observation.peak_bytes is not None]
        if not fitted:
            return None
        if self._one_batch_measured():
            top = max(fitted, key=lambda a: a.observation.peak_bytes or 0)
            own = float(top.observation.peak_bytes or 0) - top.observation.start_bytes
            # Every moment of a run after its model is built holds the parameters it builds: the line
            # from the peak through them bounds every phase's growth (``line.through_fixed``).
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

    def _need_at(self, batch: int) -> float | None:
        needs = [n for b, n in self._failed_points() if b == batch]
        return max(needs) if needs else None
