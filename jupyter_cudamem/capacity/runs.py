"""Run a cell at its batch and at a smaller one, measuring each run, and judge the runs.

The order is chosen so the namespace ends as after a normal run of the cell at its own batch:

1. at the batch as written: a warm-up that creates what a first run creates (optimizer state,
   cuDNN's plans), so later peaks are the steady state's;
2. at the smaller batch, changed where the batch lives (``batch.BatchChange``) and put back;
3. under ``torch.autocast`` at the batch as written, when asked;
4. at the batch as written again, last: its value is the cell's, and with run 1 it says whether the
   cell is repeatable. Where the smaller run gave a workspace back at once, the smaller batch runs once
   more under a cap below its own peak (``probe_workspaces``); with ``--calibrate`` the calibration's runs
   come after; after either the cell runs at its batch once more, last (``FINAL``, not a point of the line).

The line goes through runs 2 and 4. A cell with no batch is run once.

Each run starts clean, as the same cell run fresh on another card would:

- **Leftovers of the run before.** A cell that binds names it creates (``x = torch.randn(batch, ...)``,
  ``preds = model(x)``) would otherwise build the next run's ``x`` while the previous run's ``x`` and
  ``preds`` still hold their memory: the smaller run would carry the batch as written's tensors, and
  its peak (and the line's slope) would be wrong by them. Before each run the names the cell binds
  before reading them are set aside (moved to the host and unbound: ``oomfix.leftovers``, as %oomfix
  does between tries); a run that binds them again supersedes them, and a run that fails gives them
  back.
- **The allocator's cache.** The cache is emptied before each run (``release``), so the run's
  reserved peak is its own and not the larger run's before it (PyTorch's reserved peak, once reset,
  starts from what is reserved, cached blocks included). When the batch as written runs
out of memory here, the second point is a quarter of it (half the smaller batch) and the cell is not
run at its own batch again.

Knows nothing of IPython: ``run(source)`` runs IPython input and returns the last expression's value
(raising the cell's own errors); ``quiet()`` silences the cell's output for the extra runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ..errors import CudaMemError
from ..measure import DeviceMeasurement, Measurement, Meter
from ..reruns.bracket import bracket_largest
from ..reruns.graph_pools import GraphPools
from ..growth.replay import FREE, given_back_at_once
from ..growth.line import Agreement, Line, faster_than_linear, line_through, same
from ..reruns.measured import run_measured
from ..reruns.recording import Recorder
from ..units import MiB
from .prediction import Calibration, Run

if TYPE_CHECKING:
    from ..history import CellRecord
    from ..reruns.set_aside import SetAside


class Change(Protocol):
    """What ``batch.BatchChange`` offers: set the batch where it lives, and put it back."""

    def apply(self, batch: int) -> str: ...

    def restore(self) -> None: ...


@dataclass
class Measured:
    """The runs, what the last one returned, and what the device looked like."""

    runs: list[Run] = field(default_factory=list)
    value: object = None
    has_value: bool = False
    total_bytes: int | None = None  # the card the runs used, as CUDA reports it
    device_name: str | None = None
    torch_index: int | None = None
    non_pytorch_bytes: int = 0
    non_pytorch_how: str = ""
    notes: list[str] = field(default_factory=list)
    calibration: Calibration | None = None  # with --calibrate: the largest batch found to fit here
    workspaces_optional: bool = False  # the cell coped with its workspaces refused (``probe_workspaces``)

    def get(self, label: str) -> Run | None:
        return next((r for r in self.runs if r.label == label), None)

    def devices(self) -> list[int]:
        """The runs' device, as the devices a cap covers (``Hardware.capped``); none while its index or its
        size is unread, since a cap is a share of the card."""
        return [] if self.torch_index is None or not self.total_bytes else [self.torch_index]


def smaller_batch(batch: int) -> int:
    """Half the batch: far enough from it that the slope is not noise (the points span half the
    batch), near enough that the smaller run costs half the cell's time and stays in the regime
    the batch as written is in. A batch of 1 has none smaller: its second point is 2."""
    return batch // 2 if batch >= 2 else 2


def _device(measurement: Measurement) -> DeviceMeasurement | None:
    measured = [d for d in measurement.devices if d.peak_allocated_bytes is not None]
    return max(measured, key=lambda d: d.peak_allocated_bytes or 0) if measured else None


def _non_pytorch(device: DeviceMeasurement) -> tuple[int | None, str]:
    after = device.after
    reserved = after.allocator.reserved_bytes if after.allocator is not None else None
    if reserved is None or after.nvml is None:
        return None, ""
    if after.process_bytes is not None:
        return max(after.process_bytes - reserved, 0), (
            "measured here through NVML: this process's GPU memory less what PyTorch reserved"
        )
    return max(after.nvml.used_bytes - reserved, 0), (
        "measured here through NVML: the card's used memory less what PyTorch reserved (NVML does not list "
        "this process here, so other processes on the card count too)"
    )


class Runner:
    """Measures runs of one cell through a ``Meter``."""

    def __init__(
        self,
        meter: Meter,
        run: Callable[[str], object],
        is_oom: Callable[[BaseException], bool],
        release: Callable[[], None] = lambda: None,
        quiet: Callable[[], contextlib.AbstractContextManager[object]] = contextlib.nullcontext,
        set_aside: Callable[[str], SetAside] | None = None,
        recorder: Recorder | None = None,
        graph_pools: GraphPools | None = None,
    ):
        self.meter = meter
        self.run = run
        self.is_oom = is_oom
        self.release = release  # returns cached blocks: before each run, and after one that ran out of memory
        self.quiet = quiet
        # ``set_aside(source)`` unbinds what the cell will bind again and returns an object with
        # ``give_back()`` and ``drop()`` (``oomfix.leftovers.SetAside``); see the module docstring.
        self.set_aside = set_aside
        # Records the allocator's history of each run once the device is known (after the first run): the
        # plan replays the line's two runs under each card's cap (``plan.replayed_largest``).
        self.recorder = recorder
        # Resets torch.compile's CUDA graph pools before each run once the device is known (``reruns.graph_pools``):
        # each run starts as at that batch in a fresh process, not on the pools of the batches run before.
        self.graph_pools = graph_pools
        self.measured = Measured()

    def once(self, label: str, source: str, batch: int | None, autocast: bool = False, last: bool = False) -> Run:
        """One measured run; the cell's own errors (anything but running out of memory) propagate."""
        aside = self.set_aside(source) if self.set_aside is not None else None
        gc.collect()
        self.release()
        index = self.measured.torch_index
        if self.graph_pools is not None and index is not None:
            self.graph_pools.reset(index)
        returned: list[object] = []

        def attempt() -> BaseException | None:
            try:
                with contextlib.nullcontext() if last else self.quiet():
                    returned.append(self.run(source))
            except BaseException as error:  # noqa: BLE001 - the cell's error: measured, then re-raised unless an OOM
                if aside is not None:
                    aside.give_back()
                if not self.is_oom(error):
                    raise
                # The exception's frames hold the failed run's tensors: drop them before measuring on.
                with contextlib.suppress(Exception):
                    import traceback

                    traceback.clear_frames(error.__traceback__)
                return error
            return None

        measured = run_measured(attempt, self.meter, self.recorder, index)
        oom = measured.error is not None
        recorded = measured.recorded
        measurement = measured.measurement
        del measured  # its error's frames are cleared, but it is the failed run's: not kept
        value: object = returned[0] if returned else None
        if aside is not None and not oom:
            aside.drop()  # the run bound those names again
        if oom:
            gc.collect()
            self.release()
        device = _device(measurement)
        run = Run(
            label,
            batch,
            None if device is None else device.peak_allocated_bytes,
            None if device is None or device.before.allocator is None else device.before.allocator.allocated_bytes,
            None if device is None else _non_pytorch(device)[0],
            oom,
            autocast,
            None if device is None else device.peak_reserved_bytes,
            recorded,
        )
        if device is not None:
            self._note_device(device, oom)
        if last and not oom:
            self.measured.value, self.measured.has_value = value, True
        self.measured.runs.append(run)
        return run

    def _note_device(self, device: DeviceMeasurement, oom: bool) -> None:
        """Keep the card a run measured, and from a run that fitted, the memory outside PyTorch."""
        self.measured.total_bytes = device.device.total_bytes
        self.measured.device_name = device.device.name
        self.measured.torch_index = device.device.torch_index
        if not oom:
            amount, how = _non_pytorch(device)
            if amount is not None:
                self.measured.non_pytorch_bytes, self.measured.non_pytorch_how = amount, how

    def changed(self, change: Change, label: str, batch: int) -> Run:
        try:
            source = change.apply(batch)
            return self.once(label, source, batch)
        finally:
            change.restore()


AS_WRITTEN = "as written"
SMALLER = "smaller"
SMALLEST = "smaller still"
SMALLER_WARM_UP = "smaller (warm-up)"
AUTOCAST = "autocast"
AGAIN = "as written, again"
FINAL = "last run"  # with --calibrate: the cell's own last run, after the calibration (not a point of the line)
WORKSPACES = "smaller, workspaces refused"  # ``probe_workspaces``: under a cap below its own peak (not a point)


def measure_runs(
    runner: Runner,
    source: str,
    batch: int | None,
    change: Change | None,
    small: int | None = None,
    autocast_source: str | None = None,
    calibrate_at: Callable[[], CalibrationScale | None] | None = None,
    cap_at: Callable[[int], contextlib.AbstractContextManager[Sequence[int]]] | None = None,
    after_first: Callable[[], object] | None = None,
) -> Measured:
    """The runs described in the module docstring. Raises ``CudaMemError`` (one line) when they
    cannot make a plan; the cell's own errors propagate as they are. With ``calibrate_at`` (where to
    calibrate, asked once the first runs measured the memory outside PyTorch), the largest batch that
    fits there is searched for (``calibrate``) before the last run. ``after_first`` is called once the first
    run at the batch as written has run: what it left is what one plain run of the cell leaves (the caller
    keeps it, to put it back after the last run). ``cap_at(usable_bytes)`` caps PyTorch for a block and yields
    the devices it capped, none where it could not (``Hardware.capped``)."""
    measured = runner.measured
    if batch is None or change is None:
        run = runner.once(AS_WRITTEN, source, None, last=True)
        if run.oom:
            raise CudaMemError("the cell ran out of GPU memory here, and it has no batch to make smaller: no plan")
        return measured
    small = smaller_batch(batch) if small is None else small
    first = runner.once(AS_WRITTEN, source, batch)
    if after_first is not None:
        after_first()
    second = runner.changed(change, SMALLER, small)
    if second.oom:
        raise _smaller_ran_out(first, batch, small)
    if first.oom:
        return _line_below(runner, change, batch, small, second, calibrate_at)
    if autocast_source is not None:
        runner.once(AUTOCAST, autocast_source, batch, autocast=True)
    again = runner.once(AGAIN, source, batch, last=True)
    if again.oom:
        raise CudaMemError(
            f"the cell fitted at batch {batch} once and ran out of GPU memory the next time: it is not repeatable "
            "enough to plan (does it keep memory from run to run?)"
        )
    # After the line's points, so that what these runs may leave (a library's buffer for a new shape, the
    # gradients of a run that ran out of memory) cannot move their starts; then the cell runs at its batch
    # once more, last, for its value.
    probed = cap_at is not None and probe_workspaces(runner, change, second, cap_at)
    if calibrate_at is not None:
        calibrate(runner, change, calibrate_at())
    if probed or calibrate_at is not None:
        runner.once(FINAL, source, batch, last=True)
    return measured


def _smaller_ran_out(first: Run, batch: int, small: int) -> CudaMemError:
    if first.oom:
        return CudaMemError(f"the cell ran out of GPU memory at both batch {batch} and {small}: no plan; try --small N")
    return CudaMemError(
        f"the cell ran out of GPU memory at batch {small} but not at {batch}: "
        + ("pass a smaller --small N" if small > batch else
           "it is not repeatable enough to plan (does it keep memory from run to run?)")
    )


def _line_below(
    runner: Runner,
    change: Change,
    batch: int,
    small: int,
    second: Run,
    calibrate_at: Callable[[], CalibrationScale | None] | None,
) -> Measured:
    """The batch as written ran out of memory and ``second`` (at ``small``) fitted: the line goes through it
    and a batch smaller still, the smaller run measured again if it was the warm-up."""
    measured = runner.measured
    smallest = max(small // 2, 1)
    if smallest == small:
        raise CudaMemError(f"the cell ran out of GPU memory at batch {batch} and only batch {small} fits here: no line")
    third = runner.changed(change, SMALLEST, smallest)
    if (third.start_bytes or 0) - (second.start_bytes or 0) > REPEAT_SLACK:
        # The smaller run created what a first run creates (optimizer state), which the run that ran out
        # of memory never reached: it was the warm-up. Measure it again, now in the steady state.
        measured.runs[measured.runs.index(second)] = dataclasses.replace(second, label=SMALLER_WARM_UP)
        runner.changed(change, SMALLER, small)
    measured.notes.append(
        f"batch {batch} ran out of GPU memory here, so the line goes through batches {small} and {smallest}; "
        f"the cell was not run at {batch} again (its values are set back to {batch})"
    )
    if calibrate_at is not None:
        last_point = measured.runs[-1].batch or small
        calibrate(runner, change, calibrate_at())
        runner.changed(change, FINAL, last_point)  # the names end with a fitting run's, not a calibration run's
    return measured


WORKSPACE_PROBE_MIN = 2 * MiB
"""Workspaces smaller than this are not probed: refusing them moves no card's batch by a block."""


def probe_workspaces(runner: Runner, change: Change, smaller: Run,
                     cap_at: Callable[[int], contextlib.AbstractContextManager[Sequence[int]]]) -> bool:
    """Run the cell at ``smaller``'s batch again under a cap half its largest workspace below its own reserved
    peak, and record whether it coped (``Measured.workspaces_optional``).

    Why: a request made and given back at once is a library's workspace, and uncapped runs make every one
    they ask for. cuDNN's convolutions size theirs by what they can get and fall back to an algorithm that
    needs less (on the H100, a convnet's inference asked for 2.3 GiB uncapped and fitted a 16 GiB card at
    413 where replaying its workspaces as needed said 271); cuDNN's RNNs fail without theirs (a GRU's
    975 MiB backward workspace: taken as optional, the plan said 643 where 529 fit). The runs cannot tell
    them apart; a run that fits below its own peak can only have done without a workspace, so the plan's
    replay takes them as optional only then (``plan.replayed_largest``). Returns whether the probe ran."""
    recorded = smaller.recorded
    if recorded is None or smaller.batch is None or smaller.peak_reserved_bytes is None:
        return False
    workspace = max((recorded.events[i][2] for i in given_back_at_once(recorded.events)), default=0)
    if workspace < WORKSPACE_PROBE_MIN:
        return False
    try:
        with cap_at(smaller.peak_reserved_bytes - workspace // 2) as capped:
            if not capped:
                return False  # uncapped it would fit whatever the library does: nothing learnt
            run = runner.changed(change, WORKSPACES, smaller.batch)
    except Exception as error:  # noqa: BLE001 - an error only the cap brought (a library's own): not coped
        runner.measured.notes.append(f"with its workspaces refused the cell raised {type(error).__name__}")
        return True
    runner.measured.workspaces_optional = not run.oom
    return True


CALIBRATION = "largest here"

CALIBRATION_RUNS = 12
"""At most this many runs search for the largest batch that fits: from the line's guess, steps of
``CALIBRATION_STEP`` until one fits and one does not, then halving the gap to ``CALIBRATION_RESOLUTION``
(six halvings from a 25% gap at batches in the hundreds). The searches of ``benchmarks/plan.py`` and
``benchmarks/plan_sweep.py`` took 6-10 runs. When they run out, what fitted so far is used, and the plan
says the search stopped early."""

CALIBRATION_STEP = 1.25
"""Stepping from the line's guess by a quarter: the uncapped allocated line's guess was 0.67-1.15x the
largest batch that fits on the four workloads of ``benchmarks/plan_calibration.py`` (its ``allocated``
predictions), so one or two steps bracket it; a step of a half would double the halvings after it."""

CALIBRATION_RESOLUTION = 0.005
"""The search stops when the batch that fitted and the one that did not are within 0.5% of each other (or
adjacent): the ratio taken from it is then at most 0.5% cautious, well inside the plan's margin."""


@dataclass(frozen=True)
class CalibrationScale:
    """Where to calibrate: what PyTorch may use there (``usable_bytes``), the card that is, and how to cap
    PyTorch at it on this card for a run (``cap``: a context manager; ``None`` for this card itself).

    The smallest card of the plan that is smaller than this card, played by a cap: what a cap costs a cell
    beyond its allocated peak shrinks as the card grows (the LSTM of ``benchmarks/plan.py``: 1.146 at a
    16 GiB cap, 1.136 at 40 GiB, 1.134 at 80 GiB; the tutorial's CNN needed more than 1.12 at a T4's cap
    and 1.089 at 80 GiB), so a ratio measured at the smallest card is the exact one there and a cautious
    one for the larger cards, while one measured at the largest promises the small ones too much."""

    usable_bytes: int
    card: str
    cap: Callable[[], contextlib.AbstractContextManager[object]] | None = None


def calibrate(runner: Runner, change: Change | None, scale: CalibrationScale | None) -> Calibration | None:
    """Find the largest batch that fits at ``scale`` by running the cell (``CALIBRATION`` runs, each
    clean as any other, put back after, under the scale's cap), guessing from a line through the runs so
    far. A run that raises anything but running out of memory ends the search (its error is in
    ``Measured.notes``)."""
    measured = runner.measured
    usable = None if scale is None else scale.usable_bytes
    points = [r for r in measured.runs if not r.oom and r.batch is not None and r.peak_bytes is not None
              and r.label in (AS_WRITTEN, SMALLER, SMALLEST)]
    if change is None or usable is None or len({r.batch for r in points}) < 2:
        measured.notes.append("--calibrate: no line to start from (or this card's memory unread): not calibrated")
        return None
    guess_line = line_through([(r.batch, r.peak_bytes) for r in points])  # type: ignore[misc]
    guess = max(guess_line.largest_batch(usable), 1) if guess_line.slope_bytes > 0 else max(r.batch or 1 for r in points)
    stopped = ""

    def fits(batch: int) -> bool | None:
        nonlocal stopped
        try:
            with scale.cap() if scale is not None and scale.cap is not None else contextlib.nullcontext():
                return not runner.changed(change, CALIBRATION, batch).oom
        except Exception as error:  # noqa: BLE001 - the cell's own error at a batch this large ends the search
            stopped = f"batch {batch} raised {type(error).__name__}: {error}".split("\n")[0][:200]
            return None

    found_bracket = bracket_largest(fits, guess, CALIBRATION_RUNS, CALIBRATION_STEP, CALIBRATION_RESOLUTION)
    fitted, failed, runs = found_bracket.fitted, found_bracket.failed, found_bracket.runs
    if fitted is None:
        measured.notes.append(
            "--calibrate: " + (stopped or f"no batch fitted here in {runs} runs (down to {failed})") + ": not calibrated"
        )
        return None
    if not stopped and (failed is None or failed - fitted > max(1, int(fitted * CALIBRATION_RESOLUTION))):
        stopped = f"after {runs} runs batch {fitted} fitted" + ("" if failed is None else f" and {failed} did not")
    found = Calibration(fitted, failed, usable, runs, stopped, "this card" if scale is None else scale.card)
    measured.calibration = found
    if stopped:
        measured.notes.append(f"--calibrate stopped early ({stopped}): the ratio is taken at batch {fitted}")
    return found


@dataclass(frozen=True)
class Judged:
    """The line (``None`` for a cell with no batch) and the agreements the plan reports."""

    line: Line | None
    agreements: tuple[Agreement, ...]
    autocast_line: Line | None
    notes: tuple[str, ...]
    reserved_line: Line | None = None  # through the same runs' reserved peaks; ``None`` when not read
    replay_runs: tuple[Run, Run] | None = None  # the line's runs at its smallest and largest batch, both recorded
    workspaces_optional: bool = False  # ``Measured.workspaces_optional``


def judge(measured: Measured, batch: int | None, history_peak: tuple[str, int] | None = None) -> Judged:
    """Fit the line and check the runs agree with it; ``CudaMemError`` (one line) when they do not."""
    runs = {r.label: r for r in measured.runs}
    _check_read(measured.runs)
    notes: list[str] = []
    if batch is None:
        return Judged(None, (), None, ())
    warm_up = _warm_up(runs.get(AS_WRITTEN), runs.get(AGAIN), batch, notes)
    points = [r for r in measured.runs if r.label in (SMALLER, SMALLEST, AGAIN) and not r.oom]
    if len({r.batch for r in points}) < 2:
        raise CudaMemError("fewer than two batch sizes fitted here: no line; try a smaller second batch with --small N")
    starts = [r.start_bytes for r in points]
    if len(set(starts)) > 1 and max(starts) - min(starts) > REPEAT_SLACK:  # type: ignore[type-var,operator]
        raise CudaMemError(
            "the cell is not repeatable: each run started with more memory allocated than the one before "
            "(it keeps memory from run to run); a plan needs a cell that leaves memory as it found it"
        )
    line = line_through([(r.batch, r.peak_bytes) for r in points])  # type: ignore[misc]
    top = max(points, key=lambda r: r.batch or 0)
    low = min(points, key=lambda r: r.batch or 0)
    start = min(r.start_bytes or 0 for r in points)
    replay_runs = (low, top) if low.recorded is not None and top.recorded is not None else None
    if line.slope_bytes <= 0:
        line = _flat_line(points, replay_runs, batch, notes)
    if faster_than_linear(line, start, top.peak_bytes or 0):
        raise CudaMemError(
            f"the peak grows faster than the batch ({line.slope_bytes / MiB:,.2f} MiB per sample from two runs puts "
            f"the part that does not depend on the batch at {line.intercept_bytes / MiB:,.0f} MiB, below the "
            f"{start / MiB:,.0f} MiB held before the cell): a line would promise batches that do not fit"
        )
    agreements: list[Agreement] = []
    for run in measured.runs:
        if run.label == AS_WRITTEN and not warm_up and not run.oom and run.batch is not None and run.peak_bytes is not None:
            agreements.append(Agreement("the first run", run.batch, run.peak_bytes, line.peak(run.batch)))
    if history_peak is not None:
        label, peak = history_peak
        agreements.append(Agreement(label, batch, peak, line.peak(batch)))
    autocast_line = _autocast_line(runs.get(AUTOCAST), line, notes)
    reserved_line = _reserved_line(points, line, batch)
    return Judged(line, tuple(agreements), autocast_line, tuple(notes), reserved_line, replay_runs,
                  measured.workspaces_optional)


def _check_read(runs: list[Run]) -> None:
    """``CudaMemError`` unless the allocator's peak was read in every run that fitted, and in one at least."""
    if all(r.peak_bytes is None for r in runs):
        raise CudaMemError("the cell used no GPU memory through PyTorch (or none could be read): nothing to plan")
    if any(r.peak_bytes is None for r in runs if not r.oom):
        raise CudaMemError("PyTorch's allocator could not be read during every run: no plan")


def _flat_line(points: list[Run], replay_runs: tuple[Run, Run] | None, batch: int, notes: list[str]) -> Line:
    """The peak did not grow with the batch: a flat line at the highest peak where the two recorded runs'
    requests did grow (the replay plans it), else ``CudaMemError``."""
    low, top = replay_runs if replay_runs is not None else (points[0], points[0])
    if replay_runs is None or requested_bytes(top) - requested_bytes(low) <= REPEAT_SLACK:
        raise CudaMemError(
            f"the peak did not grow with the batch ({', '.join(f'{r.batch}: {(r.peak_bytes or 0) / MiB:,.0f} MiB' for r in points)}): "
            f"is {batch!r} really the cell's batch? Plan it as fixed-size by setting the batch in the cell"
        )
    # A fine-tune's peak at small batches is its optimizer's step (weights, gradients, AdamW's state),
    # which no batch changes; the batch's tensors peak in the backward pass, below it. The replay of
    # the two recorded runs sees both phases and finds where the batch's reaches the cap.
    notes.append(
        f"the peak did not grow from batch {low.batch} to {top.batch} ({(low.peak_bytes or 0) / MiB:,.0f} and "
        f"{(top.peak_bytes or 0) / MiB:,.0f} MiB): a phase that does not depend on the batch (an optimizer's "
        "step) sets it there; the allocator's replay of the two runs finds where the batch's phases reach "
        "each card's memory"
    )
    return Line(0.0, float(max(r.peak_bytes or 0 for r in points)))


def _warm_up(first: Run | None, again: Run | None, batch: int, notes: list[str]) -> bool:
    """Whether the first run at the batch as written was a warm-up (the run after it started with more
    kept: optimizer state, caches), noted in ``notes``; ``CudaMemError`` when the two peaks disagree."""
    if first is None or again is None or first.oom:
        return False
    assert first.peak_bytes is not None and again.peak_bytes is not None
    assert first.start_bytes is not None and again.start_bytes is not None
    if again.start_bytes - first.start_bytes > REPEAT_SLACK:
        notes.append(
            f"the first run kept {(again.start_bytes - first.start_bytes) / MiB:,.0f} MiB (optimizer state, "
            "caches): it counts as a warm-up"
        )
        return True
    if not same(first.peak_bytes, again.peak_bytes, first.start_bytes):
        raise CudaMemError(
            f"the cell is not repeatable: two runs at batch {batch} peaked at {first.peak_bytes / MiB:,.0f} "
            f"and {again.peak_bytes / MiB:,.0f} MiB; a plan needs a cell that does the same work each run"
        )
    return False


def _autocast_line(autocast: Run | None, line: Line, notes: list[str]) -> Line | None:
    """The line under autocast, through the float32 line's fixed part and the run under autocast; where
    there is none, why in ``notes``."""
    if autocast is None or not autocast.batch:
        return None
    if line.slope_bytes <= 0:
        notes.append("under autocast: no line either, where the float32 runs' peak did not grow with the batch")
        return None
    if autocast.oom or autocast.peak_bytes is None:
        notes.append("the run under autocast ran out of memory: nothing to say about what it buys")
        return None
    slope = (autocast.peak_bytes - line.intercept_bytes) / autocast.batch
    if slope > 0:
        # Under autocast the weights, their gradients and the optimizer state stay float32: the
        # part that does not depend on the batch is the same; the activations shrink.
        return Line(slope, line.intercept_bytes)
    notes.append("under autocast the peak fell below the part that does not depend on the batch: no line for it")
    return None


def _reserved_line(points: list[Run], line: Line, batch: int) -> Line | None:
    """The line of reserved peaks, where every point read one."""
    reserved = [(r.batch, r.peak_reserved_bytes) for r in points if r.peak_reserved_bytes is not None]
    if len(reserved) != len(points):
        return None
    candidate = line_through(reserved)  # type: ignore[arg-type]
    # Reserved covers allocated: a reserved line below the allocated one at the batch as written is a
    # misreading (the allocator's counters from another device, say), never a smaller need.
    if candidate.slope_bytes > 0 and candidate.peak(batch) >= line.peak(batch):
        return candidate
    return None


def requested_bytes(run: Run) -> int:
    """What a recorded run asked the allocator for in all (0 where it was not recorded): a cell whose
    batch is its batch asks for more at a larger one, even where its peak is a phase no batch changes."""
    return 0 if run.recorded is None else sum(size for kind, _, size, _ in run.recorded.events if kind != FREE)


REPEAT_SLACK = 4 * MiB
"""Allocated bytes at a run's start that may differ between runs without meaning the cell kept
memory (a cached index tensor, a counter on the GPU)."""


def history_match(records: Iterable[CellRecord], key: str, batch: int | None) -> Iterator[tuple[str, int]]:
    """Earlier measurements (``%%cudamem``'s history) of the cell ``key`` that ran without error."""
    for record in reversed(list(records)):
        if getattr(record, "source_key", None) != key:
            continue
        measurement = record.measurement
        if measurement.error is not None or measurement.peak_allocated_bytes is None:
            continue
        yield f"%%cudamem {record.label}", int(measurement.peak_allocated_bytes)
