"""``%cudamem on``: a line after each cell that moves GPU memory, from IPython's ``pre_run_cell`` and
``post_run_cell`` events. The measuring (meter, snapshot, history) is ``CudaMem``'s; this is when it runs."""

from __future__ import annotations

import ast
import builtins
import difflib
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..errors import CudaMemError
from ..report import one_line
from ..report.cell import left_finding
from ..units import format_bytes
from .base import current_cell_number
from .options import size_setting

if TYPE_CHECKING:
    from .cudamem import CudaMem

MODES = ("on", "off", "status")
AUTO_ALLOWED = "a size such as 1MiB, 512KB or 4096 (bytes), or 0 for a line after every cell"


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


def mode_of(options: str, statement: str, namespace: Mapping[str, Any]) -> str | None:
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


class EveryCell:
    """The every-cell mode of one ``CudaMem``: its IPython callbacks and the threshold of a line."""

    def __init__(self, cudamem: CudaMem):
        self.cudamem = cudamem
        self.on = False
        # Set while a %%cudamem cell runs: that cell is measured by the magic, not again here.
        self.inside_magic = False
        self._baseline: Any = None
        self._depth = 0
        self._threshold_text: str | int | None = None
        self._threshold_value = 0

    def switch(self, command: str) -> None:
        """``on``, ``off`` or ``status``; prints which is active."""
        cudamem = self.cudamem
        events = cudamem.shell.events
        if command == "on" and not self.on:
            events.register("pre_run_cell", self.pre_run_cell)
            events.register("post_run_cell", self.post_run_cell)
            self.on = True
        elif command == "off" and self.on:
            self.stop()
            self._depth = 0
        threshold = format_bytes(self.threshold_bytes())
        state = f"on: a line after each cell that moves GPU memory by {threshold} or more" if self.on else "off"
        print(f"cudamem every-cell mode {state}")
        if self.on and not cudamem.gpu_present():
            cudamem.note("no GPU measured here: " + "; ".join(cudamem.hardware.unavailable()))

    def stop(self) -> None:
        events = self.cudamem.shell.events
        for name, callback in (("pre_run_cell", self.pre_run_cell), ("post_run_cell", self.post_run_cell)):
            try:
                events.unregister(name, callback)
            except ValueError:
                pass
        self.on = False
        self._baseline = None

    def threshold_bytes(self) -> int:
        threshold = self.cudamem.auto_threshold
        if threshold != self._threshold_text:  # parsed once per setting, not once per cell
            self._threshold_value = size_setting("CudaMem.auto_threshold", threshold, AUTO_ALLOWED) or 0
            self._threshold_text = threshold
        return self._threshold_value

    def pre_run_cell(self, info: Any = None) -> None:
        # A cell may run others (%oomfix reruns through shell.run_cell): those nested cells belong
        # to the outer one's measurement, so only the outermost cell is measured.
        self._depth += 1
        if self._depth > 1:
            return
        raw = getattr(info, "raw_cell", "") or ""
        if self.inside_magic or raw.lstrip().startswith(("%%cudamem", "%cudamem")):
            self._baseline = None
            return
        cudamem = self.cudamem
        try:
            snapshot = cudamem.snapshot(raw)
            meter = cudamem.meter()
            self._baseline = (meter, meter.start(), raw, snapshot)
        except Exception as error:  # never break the user's cell because a reading failed
            self._baseline = None
            cudamem.note(f"every-cell measurement skipped: {error}")

    def post_run_cell(self, result: Any = None) -> None:
        raw = getattr(getattr(result, "info", None), "raw_cell", None)
        if raw is not None and not raw.strip():
            return  # IPython skips pre_run_cell for a blank cell but still sends post_run_cell
        self._depth = max(self._depth - 1, 0)
        if self._depth > 0:
            return
        pending, self._baseline = self._baseline, None
        if pending is None or self.inside_magic:
            return
        cudamem = self.cudamem
        meter, baseline, raw, snapshot = pending
        try:
            failure = getattr(result, "error_in_exec", None) or getattr(result, "error_before_exec", None)
            measurement = meter.stop(baseline, error=None if failure is None else type(failure).__name__)
            # IPython before 9.8 gives no number to a cell run with store_history=False (silent runs, tests).
            count = getattr(result, "execution_count", None)
            if count is None:
                count = current_cell_number(cudamem.shell)
            del failure  # the traceback is IPython's to keep, not ours
            left = cudamem.left_behind(measurement, snapshot)
            record = cudamem.record(count, raw, measurement)
            if measurement.error == "OutOfMemoryError" or measurement.moved_at_least(self.threshold_bytes()):
                print(one_line(measurement, f"[{count}]" if count is not None else ""))
                if left is not None:  # the line a %%cudamem report leads with: the largest leak's advice only
                    print("  " + left_finding(left))
                if record.growth is not None:
                    print(f"  {record.growth.describe()}")
        except Exception as error:
            cudamem.note(f"every-cell measurement failed: {error}")
