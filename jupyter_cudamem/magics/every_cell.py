"""``%cudamem on``: a line after each cell that moves GPU memory, from IPython's ``pre_run_cell`` and
``post_run_cell`` events. The meter and the settings are ``measuring``'s, who holds what a cell left
``left_attribution``'s; this is when they run."""

from __future__ import annotations

import ast
import builtins
import difflib
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from ..errors import CudaMemError
from ..hardware import Hardware
from ..history import History
from ..report import one_line
from ..report.cell import left_finding
from ..units import format_bytes
from .base import current_cell_number, note
from .cell_starts import CellStarts
from .left_attribution import LeftAttribution
from .measuring import CellSettings, gpu_present, record

if TYPE_CHECKING:
    from IPython.core.interactiveshell import ExecutionInfo, ExecutionResult, InteractiveShell

    from ..attribution.left import NamespaceSnapshot
    from ..measure import Baseline, Meter

MODES = ("on", "off", "status")


def _assigns(statement: str, name: str) -> bool:
    """Whether ``statement`` binds ``name`` first (``on = 3``), so it is code, not a mode word."""
    try:
        first = ast.parse(statement).body[0]
    except (SyntaxError, ValueError, IndexError):
        return False
    targets = first.targets if isinstance(first, ast.Assign) else [getattr(first, "target", None)]
    return any(isinstance(target, ast.Name) and target.id == name for target in targets)


def _parses(statement: str) -> bool:
    try:
        ast.parse(statement)
    except (SyntaxError, ValueError):
        return False
    return True


def mode_of(options: str, statement: str, namespace: Mapping[str, object]) -> str | None:
    """``on``/``off``/``status`` of the line form; one line saying what to type for a near miss.

    A name the user defined (``ON = 1``) is theirs to measure; so is any statement that parses.
    """
    if statement in MODES and not options:
        return statement
    words = statement.split()
    if not words:
        return None
    first = words[0].lower()
    if statement.isidentifier():
        if statement in namespace or hasattr(builtins, statement):
            return None
        close = difflib.get_close_matches(statement.lower(), MODES, n=1, cutoff=0.75)
        if close:
            extra = " (no options)" if options else ""
            raise CudaMemError(
                f"{statement!r} is not defined; to switch every-cell measurement type %cudamem {close[0]}{extra} "
                f"(one of {', '.join(MODES)}, lower case)"
            )
        return None
    if first in MODES:
        name = re.match(r"\w*", statement).group()  # type: ignore[union-attr]
        defined = name in namespace or hasattr(builtins, name)
        if not _parses(statement) or not (defined or _assigns(statement, name)):
            raise CudaMemError(f"%cudamem {first} takes nothing after it: type %cudamem {first}")
    return None


class _MeasuredByMagic:
    """``with every_cell.measured_by_magic():`` (a class: a generator's context costs ten times as much)."""

    __slots__ = ("_every_cell",)

    def __init__(self, every_cell: EveryCell):
        self._every_cell = every_cell

    def __enter__(self) -> None:
        self._every_cell.inside_magic = True

    def __exit__(self, *exc_info: object) -> None:
        self._every_cell.inside_magic = False


class EveryCell:
    """The every-cell mode on one shell: its IPython callbacks. ``settings`` reads ``CudaMem``'s settings, once
    as each cell starts; ``attribution`` names who holds what a cell left; each measured cell goes into
    ``history``; each starts from ``cell_starts``' reading."""

    def __init__(self, shell: InteractiveShell, hardware: Hardware, attribution: LeftAttribution, history: History,
                 settings: Callable[[], CellSettings], cell_starts: CellStarts):
        self.shell = shell
        self.cell_starts = cell_starts
        self.hardware = hardware
        self.attribution = attribution
        self.history = history
        self.settings = settings
        self.on = False
        # Set while a %%cudamem cell runs (``measured_by_magic``): that cell is measured by the magic, not again here.
        self.inside_magic = False
        self._baseline: tuple[CellSettings, Meter, Baseline, str, NamespaceSnapshot | None] | None = None
        self._depth = 0
        self._meter: tuple[CellSettings, Meter] | None = None  # the meter of the settings kept (``CudaMem.settings``)

    def switch(self, command: str) -> None:
        """``on``, ``off`` or ``status``; prints which is active."""
        events = self.shell.events
        settings = self.settings()
        if command == "on" and not self.on:
            events.register("pre_run_cell", self.pre_run_cell)
            events.register("post_run_cell", self.post_run_cell)
            self.on = True
        elif command == "off" and self.on:
            self.stop()
            self._depth = 0
        threshold = format_bytes(settings.auto_threshold_bytes)
        state = f"on: a line after each cell that moves GPU memory by {threshold} or more" if self.on else "off"
        print(f"cudamem every-cell mode {state}")
        if self.on and not gpu_present(self.hardware):
            note("no GPU measured here: " + "; ".join(self.hardware.unavailable()))

    def stop(self) -> None:
        events = self.shell.events
        for name, callback in (("pre_run_cell", self.pre_run_cell), ("post_run_cell", self.post_run_cell)):
            try:
                events.unregister(name, callback)
            except ValueError:
                pass
        self.on = False
        self._baseline = None

    def measured_by_magic(self) -> _MeasuredByMagic:
        """While a ``%%cudamem`` cell's body runs: the magic measures it, so this does not."""
        return _MeasuredByMagic(self)

    def pre_run_cell(self, info: ExecutionInfo | None = None) -> None:
        # A cell may run others (%oomfix reruns through shell.run_cell): those nested cells belong
        # to the outer one's measurement, so only the outermost cell is measured.
        self._depth += 1
        if self._depth > 1:
            return
        raw = getattr(info, "raw_cell", "") or ""
        if self.inside_magic or raw.lstrip().startswith(("%%cudamem", "%cudamem")):
            self._baseline = None
            return
        try:
            settings = self.settings()
            started = self.cell_starts.reading_of(info)
            snapshot = self.attribution.snapshot(settings, raw, started)
            kept = self._meter
            if kept is None or kept[0] is not settings:  # a meter holds no cell's state: one serves while they stand
                kept = self._meter = (settings, settings.meter(self.hardware))
            meter = kept[1]
            self._baseline = (settings, meter, meter.start(started), raw, snapshot)
        except Exception as error:  # never break the user's cell because a reading failed
            self._baseline = None
            note(f"every-cell measurement skipped: {error}")

    def post_run_cell(self, result: ExecutionResult | None = None) -> None:
        raw = getattr(getattr(result, "info", None), "raw_cell", None)
        if raw is not None and not raw.strip():
            return  # IPython skips pre_run_cell for a blank cell but still sends post_run_cell
        self._depth = max(self._depth - 1, 0)
        if self._depth > 0:
            return
        pending, self._baseline = self._baseline, None
        if pending is None or self.inside_magic:
            return
        settings, meter, baseline, raw, snapshot = pending
        try:
            failure = getattr(result, "error_in_exec", None) or getattr(result, "error_before_exec", None)
            measurement = meter.stop(baseline, error=None if failure is None else type(failure).__name__)
            # IPython before 9.8 gives no number to a cell run with store_history=False (silent runs, tests).
            count = getattr(result, "execution_count", None)
            if count is None:
                count = current_cell_number(self.shell)
            del failure  # the traceback is IPython's to keep, not ours
            left = self.attribution.left_behind(settings, measurement, snapshot)
            cell_record = record(self.history, count, raw, measurement)
            if measurement.error == "OutOfMemoryError" or measurement.moved_at_least(settings.auto_threshold_bytes):
                print(one_line(measurement, f"[{count}]" if count is not None else ""))
                if left is not None:  # the line a %%cudamem report leads with: the largest leak's advice only
                    print("  " + left_finding(left))
                if cell_record.growth is not None:
                    print(f"  {cell_record.growth.describe()}")
        except Exception as error:
            note(f"every-cell measurement failed: {error}")
