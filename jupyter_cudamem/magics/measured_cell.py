"""One ``%%cudamem`` cell, measured: run as a plain cell under the ``--limit`` cap, the ``--trace`` recording,
the ``--nvtx`` range and the ``--breakdown`` counting it asked for, then its report built and its record kept.

The measuring is ``measure.Meter``'s, the cap ``Hardware.pytorch_capped``'s, the trace ``trace.traced``'s,
the breakdown ``breakdown``'s; this is the order they run in and what a failure of each costs the user.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..hardware import Hardware
from ..history import History
from ..measure import Measurement, Meter
from ..report import CellReport
from ..trace import TraceSummary, traced
from .base import current_cell_number, note, show_report
from .cell_starts import CellStarts
from .cellrun import Ran, run_cell_body, whole_cell
from .every_cell import EveryCell
from .left_attribution import LeftAttribution
from .measuring import CellSettings, PeakCounter, record

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

    from ..breakdown import Breakdown

# Entered where a cell needs no stack: never given a context, so the same empty one serves every cell.
_NO_STACK = ExitStack()


@dataclass(frozen=True)
class MeasuredCell:
    """A cell that ran measured: its report, and the value it displays (``NO_VALUE`` for none or a trailing
    ``;``), which the line form returns as ``%time`` does."""

    report: CellReport
    value: object


class CellMeasurer:
    """Runs cells of one shell measured: ``attribution`` names who holds what a cell left, each measured
    cell goes into ``history``, ``every_cell`` does not measure the cell again, and a cell that is the magic
    alone starts from ``cell_starts``' reading."""

    def __init__(self, shell: InteractiveShell, hardware: Hardware, attribution: LeftAttribution, history: History,
                 every_cell: EveryCell, cell_starts: CellStarts):
        self.shell = shell
        self.cell_starts = cell_starts
        self.hardware = hardware
        self.attribution = attribution
        self.history = history
        self.every_cell = every_cell

    def measure(
        self, cell: str, settings: CellSettings, meter: Meter, limit_bytes: int | None, trace: bool,
        show: bool = True, breakdown: bool = False, nvtx: bool = False, verbose: bool = False,
        show_values: bool = True,
    ) -> MeasuredCell | None:
        """Run ``cell`` as a plain cell, measured; ``None`` when it failed (its error shown as a plain cell's).
        ``show_values``: display the cell's values as a plain cell does (the line form returns its value instead).

        A body that does not compile gets no report: nothing ran. When reading the counters after a
        failed cell fails too (a sticky CUDA error makes ``synchronize()`` raise again), the user's
        error is still the one shown, after a one-line note.
        """
        __tracebackhide__ = True  # noqa: F841
        shell = self.shell
        count = current_cell_number(shell)
        label = f"[{count}]"
        # Where the magic is the cell, PyTorch's counters as the cell started were read already.
        started = self.cell_starts.reading_of(whole_cell(shell))
        snapshot = self.attribution.snapshot(settings, cell, started)
        ran: Ran | None = None
        measurement: Measurement | None = None
        tracing: list[TraceSummary] | None = None
        tracker: PeakCounter | None = None
        try:
            # The stack only where something is entered: it costs a few µs a cell.
            with ExitStack() if limit_bytes or trace or nvtx else _NO_STACK as stack:
                cap_note = stack.enter_context(self.hardware.pytorch_capped(limit_bytes, meter.devices)) if limit_bytes else None
                tracing = stack.enter_context(self._tracing(settings, count)) if trace else None
                if nvtx:
                    stack.enter_context(self._nvtx_range(settings, count, cell))
                baseline = meter.start(None if limit_bytes else started)  # a cap emptied the cache since
                with self.every_cell.measured_by_magic():
                    if breakdown:
                        with self._tracker(settings) as tracker:
                            ran = run_cell_body(shell, cell)
                    else:
                        ran = run_cell_body(shell, cell)
                if ran.started:
                    error_name = None if ran.error is None else type(ran.error).__name__
                    measurement = meter.stop(baseline, error=error_name, limit_bytes=cap_note)
        except Exception as failure:
            if ran is None or ran.error is None:
                raise
            note(f"could not read GPU memory after the cell ({type(failure).__name__}: {failure}); your error follows")
        if measurement is None:  # it did not compile (a plain cell's SyntaxError), or the reading failed: no report
            assert ran is not None
            ran.fail(shell)  # outside the `except`: the user's error carries no context of ours
            return None
        traces = tuple(tracing or ())
        left = self.attribution.left_behind(settings, measurement, snapshot, ran.value, ran.error)
        cell_record = record(self.history, count, cell, measurement)
        breakdowns = self._breakdowns(tracker, measurement) if tracker is not None else ()
        report = CellReport(
            measurement, label=label, traces=traces, left=left, growth=cell_record.growth, breakdowns=breakdowns,
            verbose=verbose,
        )
        del left, snapshot, tracker
        if show_values:
            ran.show_values(shell)
        if ran.error is not None:
            if show:
                show_report(shell, report)
            ran.fail(shell)
            return None
        return MeasuredCell(report, ran.value)

    def _tracker(self, settings: CellSettings) -> PeakCounter:
        """What counts the cell's tensors for --breakdown (imports torch: only when asked)."""
        if settings.breakdown_tracker is not None:
            return settings.breakdown_tracker(self.shell.user_ns)
        from ..sources.torch_breakdown import PeakTracker

        return PeakTracker(self.shell.user_ns)

    def _breakdowns(self, tracker: PeakCounter, measurement: Measurement) -> tuple[Breakdown, ...]:
        """Where each measured device's peak went; a failure of ours costs the user only this part."""
        from ..breakdown import breakdowns_for

        peaks = {d.device.label: d.peak_allocated_bytes for d in measurement.devices if d.peak_allocated_bytes}
        start = {d.device.label: d.before.allocator.allocated_bytes for d in measurement.devices if d.before.allocator}
        try:
            return breakdowns_for(peaks, tracker.peaks(), start)
        except Exception as failure:  # noqa: BLE001  a bug of ours must not cost the user the report
            note(f"could not break the peak down: {type(failure).__name__}: {failure}")
            return ()

    def _nvtx_range(self, settings: CellSettings, count: int | None, cell: str) -> AbstractContextManager[None]:
        from ..sources.nvtx import TorchNvtx, range_name

        ranges = settings.nvtx_ranges if settings.nvtx_ranges is not None else TorchNvtx()
        return ranges.range(range_name(count, cell))

    def _tracing(self, settings: CellSettings, count: int | None) -> AbstractContextManager[list[TraceSummary]]:
        return traced(self.hardware.allocator, settings.trace_max_entries, settings.trace_dir, count, self._describe_file)

    def _describe_file(self, filename: str) -> str:
        formatter = getattr(self.shell.compile, "format_code_name", None)
        if formatter is not None:
            named = formatter(filename)
            if named:
                return named[1]
        return filename
