"""``%%cudamem``, ``%cudamem`` (a statement, or ``on``/``off`` for every cell) and ``%cudamem_history``."""

from __future__ import annotations

import argparse
import ast
import builtins
import difflib
import linecache
import re
import time
from contextlib import ExitStack, contextmanager
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from IPython.core.magic import line_cell_magic, line_magic, magics_class, no_var_expand
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display
from traitlets import Bool, Dict, Int, TraitError, Unicode, Union, observe, validate

from ..attribution.left import DEFAULT_THRESHOLD_BYTES, LeftBehind, NamespaceSnapshot, left_behind
from ..attribution.probe import default_probe
from ..errors import CudaMemError
from ..history import CellRecord, History, flat_rows, save_records, source_head
from ..measure import Measurement, Meter
from ..repeats import run_growth, source_key
from ..report import CellReport, HistoryTable, one_line
from ..report.cell import left_summary
from ..report.plot import HistoryPlot
from ..report.table import DEFAULT_SHOWN_CELLS
from ..trace import TraceSummary, save_snapshot, summarize
from ..units import format_bytes, parse_size
from .base import CudaMemMagicsBase, current_cell_number, one_line_errors, parse_devices
from .cellrun import NO_VALUE, Ran, run_cell_body

_OPTION = re.compile(r"\s*(--?[A-Za-z][\w-]*)")
_OPTION_VALUE = re.compile(r"(?:=|\s+)(\S+)")
MODES = ("on", "off", "status")


def _value_options(parser: argparse.ArgumentParser) -> frozenset[str]:
    """The option strings of ``parser`` that take a value: the parser owns the option list."""
    return frozenset(
        option for action in parser._actions if action.nargs != 0 for option in action.option_strings
    )


def _split_options(line: str, value_options: frozenset[str]) -> tuple[str, str]:
    """Split ``-o --limit 2GiB x = f()`` into its options and the statement that follows them."""
    position = 0
    while True:
        match = _OPTION.match(line, position)
        if not match:
            break
        end = match.end()
        if match.group(1) in value_options:
            value = _OPTION_VALUE.match(line, end)
            if value:
                end = value.end()
        position = end
    return line[:position].strip(), line[position:].strip()


_OFF_WORDS = ("", "0", "off", "none")


def _saved(path: str, save: Any) -> Any:
    """``--save PATH`` for records and plots alike: missing folders are created; a path that cannot be
    written is one line."""
    target = Path(path).expanduser()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        return save(target)
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise CudaMemError(f"cannot write {str(target)!r}: {reason}; choose --save a path you can write") from None


def size_setting(option: str, value: Any, allowed: str) -> int | None:
    """The bytes of a size option (``None``: off); a ``TraitError`` naming ``option`` and what it takes."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise TraitError(f"{option} takes {allowed}; got {value!r}")
        return value or None
    if isinstance(value, str):
        if value.strip().lower() in _OFF_WORDS:
            return None
        try:
            return parse_size(value)
        except CudaMemError:
            pass
    raise TraitError(f"{option} takes {allowed}; got {value!r}")


_AUTO_ALLOWED = "a size such as 1MiB, 512KB or 4096 (bytes), or 0 for a line after every cell"
_ATTRIBUTE_ALLOWED = "a size such as 64MiB or 1GB, or 'off' (or 0) to never name holders"


def _positive_int(option: str, value: int, what: str) -> int:
    if value < 1:
        raise TraitError(f"{option} takes {what} (a whole number, at least 1); got {value!r}")
    return value


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


@magics_class
class CudaMem(CudaMemMagicsBase):
    """Per-cell GPU memory. Configure with ``%config CudaMem.<option> = ...``."""

    reset_peak = Bool(
        True,
        help="Reset PyTorch's peak counters (torch.cuda.reset_peak_memory_stats) before each measured cell so the "
        "peak is the cell's own. Turn off if your code relies on max_memory_allocated() across cells.",
    ).tag(config=True)
    auto_threshold = Union(
        [Int(), Unicode()],
        default_value="1MiB",
        help="Every-cell mode prints a line only for cells whose peak rise or change in memory reaches this size.",
    ).tag(config=True)
    process_memory = Bool(
        True, help="Also read NVML's per-process memory (what this process holds beyond PyTorch's pools)."
    ).tag(config=True)
    trace_dir = Unicode("cudamem_traces", help="Where --trace saves allocator snapshots.").tag(config=True)
    trace_max_entries = Int(200_000, help="Allocation events --trace records at most.").tag(config=True)
    history_size = Int(10_000, help="Measured cells kept in the history.").tag(config=True)
    cards = Dict(help="Cards %%cudamem_plan plans for, beside its built-in table: {'name': GiB or '46068MiB' or "
                 "{'memory': ..., 'ecc': True}}; a built-in name overrides it, None removes it.").tag(config=True)
    attribute_threshold = Union(
        [Int(), Unicode()],
        default_value=f"{DEFAULT_THRESHOLD_BYTES // 1024**2}MiB",
        help="When a measured cell leaves at least this much more allocated, the report names who holds it "
        "(variables, autograd graphs, module hooks, Out[...], a failed cell's traceback), says which of it is a "
        "leak and what to change. 'off' (or 0) never does.",
    ).tag(config=True)

    breakdown = Bool(
        False,
        help="Break each %%cudamem cell's peak down by category (parameters, gradients, optimizer state, activations, "
        "temporaries, other) and by module, as --breakdown does. It slows the cell down while it runs (every "
        "operation is counted: benchmarks/breakdown.py measures by how much).",
    ).tag(config=True)
    nvtx = Bool(
        False,
        help="Wrap each %%cudamem cell in an NVTX range named after it (In[n] and its first line), as --nvtx does, so "
        "an Nsight Systems timeline shows cells.",
    ).tag(config=True)

    # Every option is checked when it is set (``%config`` prints the one line) and applies from the
    # next cell on; history_size resizes the history at once.
    @validate("auto_threshold")
    def _check_auto_threshold(self, proposal: Any) -> Any:
        size_setting("CudaMem.auto_threshold", proposal["value"], _AUTO_ALLOWED)
        return proposal["value"]

    @validate("attribute_threshold")
    def _check_attribute_threshold(self, proposal: Any) -> Any:
        size_setting("CudaMem.attribute_threshold", proposal["value"], _ATTRIBUTE_ALLOWED)
        return proposal["value"]

    @validate("history_size")
    def _check_history_size(self, proposal: Any) -> int:
        return _positive_int("CudaMem.history_size", proposal["value"], "the number of measured cells kept")

    @validate("trace_max_entries")
    def _check_trace_max_entries(self, proposal: Any) -> int:
        return _positive_int("CudaMem.trace_max_entries", proposal["value"], "the most allocation events --trace records")

    @validate("cards")
    def _check_cards(self, proposal: Any) -> Any:
        from ..capacity.cards import card_table

        try:
            card_table(proposal["value"])  # the same check %%cudamem_plan makes, now, when it is set
        except CudaMemError as error:
            raise TraitError(str(error)) from None
        return proposal["value"]

    @validate("trace_dir")
    def _check_trace_dir(self, proposal: Any) -> str:
        if not proposal["value"].strip():
            raise TraitError("CudaMem.trace_dir takes a folder for --trace's snapshots, such as 'cudamem_traces'; got ''")
        return proposal["value"]

    @observe("history_size")
    def _resize_history(self, change: Any) -> None:
        history = getattr(self, "history", None)
        if history is not None:
            history.max_records = change["new"]

    def __init__(self, shell: Any, hardware: Any, extension: Any = None, **kwargs: Any):
        super().__init__(shell, hardware, extension, **kwargs)
        self.history = History(self.history_size)
        self._auto_on = False
        self._auto_baseline: Any = None
        self._inside_magic = False
        self._parsed_options: dict[str, Any] = {}
        self._threshold_text: str | int | None = None
        self._cell_depth = 0
        self._threshold_value = 0
        self._attribute_text: str | int | None = None
        self._attribute_value: int | None = DEFAULT_THRESHOLD_BYTES
        # How tensors are recognised (``attribution.TensorProbe``); ``None`` means PyTorch's types.
        self.probe: Any = None
        # What --breakdown counts with: ``namespace -> tracker`` (``sources.torch_breakdown.PeakTracker``
        # of CUDA tensors when ``None``); and what --nvtx marks with (``sources.nvtx.TorchNvtx``).
        self.breakdown_tracker: Any = None
        self.nvtx_ranges: Any = None

    # -- shared pieces ---------------------------------------------------------------------
    def _meter(self, devices: list[int] | None = None, reset_peak: bool | None = None) -> Meter:
        return Meter(
            self.hardware,
            reset_peak=self.reset_peak if reset_peak is None else reset_peak,
            devices=devices,
            process_memory=self.process_memory,
        )

    def _gpu_present(self) -> bool:
        return self.hardware.allocator.status() is None or self.hardware.nvml.status() is None

    def _record(self, count: int | None, source: str, measurement: Measurement) -> CellRecord:
        """Add a measured cell to the history, flagged as growing when it left memory again."""
        key = source_key(source)
        growth = run_growth(self.history.records, key, measurement)
        record = CellRecord(count, source_head(source), measurement, source_key=key, growth=growth)
        self.history.add(record)
        return record

    # -- who holds what a cell left ----------------------------------------------------------
    def _attribute_bytes(self) -> int | None:
        """The attribution threshold in bytes, ``None`` when it is off."""
        setting = self.attribute_threshold
        if setting != self._attribute_text:  # parsed once per setting, not once per cell
            value = size_setting("CudaMem.attribute_threshold", setting, _ATTRIBUTE_ALLOWED)
            self._attribute_text, self._attribute_value = setting, value
        return self._attribute_value

    def _snapshot(self) -> NamespaceSnapshot | None:
        """The namespace's fingerprint as the cell starts (see ``attribution.left``); ``None`` when
        attribution is off or nothing can hold device memory (torch not imported)."""
        if self._attribute_bytes() is None:
            return None
        probe = self.probe if self.probe is not None else default_probe()
        if probe is None:
            return None
        if not self.hardware.allocator.is_initialized():
            return NamespaceSnapshot({}, frozenset())  # nothing on the device yet: all it will hold is new
        from ..ipython_state import ipython_references

        return NamespaceSnapshot.take(self.shell.user_ns, ipython_references(self.shell), probe)

    def _left_behind(
        self, measurement: Measurement, snapshot: NamespaceSnapshot | None, value: Any = None, error: Any = None
    ) -> LeftBehind | None:
        """Who holds what the cell left, when it left at least the threshold; never fails the cell."""
        threshold = self._attribute_bytes()
        if snapshot is None or threshold is None:
            return None
        left = sum(max(device.allocated_delta_bytes or 0, 0) for device in measurement.devices)
        if left < threshold:
            return None
        from ..ipython_state import cell_references

        try:
            references = cell_references(self.shell, None if value is NO_VALUE else value, error)
            return left_behind(self.shell.user_ns, references, snapshot, left, self.probe)
        except Exception as failure:  # a bug of ours must not cost the user the report
            self.note(f"could not attribute what the cell left: {type(failure).__name__}: {failure}")
            return None

    def _describe_file(self, filename: str) -> str:
        formatter = getattr(self.shell.compile, "format_code_name", None)
        if formatter is not None:
            named = formatter(filename)
            if named:
                return named[1]
        return filename

    # -- %%cudamem / %cudamem ------------------------------------------------------------------
    @magic_arguments()
    @argument("-d", "--device", help="CUDA device(s) to report, e.g. 0 or 0,1 (default: every device the cell touched).")
    @argument("-q", "--quiet", action="store_true", help="Record in the history but show no report.")
    @argument("-o", "--output", action="store_true", help="Return the result object (as %%timeit -o does) instead of displaying it.")
    @argument(
        "-l",
        "--limit",
        help="Run the cell with PyTorch capped to SIZE (e.g. 24GiB) per device through set_per_process_memory_fraction, "
        "then lift the cap: would this fit on a smaller card? The cap covers PyTorch's allocator only; the CUDA "
        "context (~0.5 GiB) and other libraries' memory, which a real card of that size also holds, are not in it.",
    )
    @argument(
        "--trace",
        action="store_true",
        help="Record allocation history for the cell, show the lines of your code holding the most memory at the peak, "
        "and save a snapshot that https://pytorch.org/memory_viz opens.",
    )
    @argument(
        "--breakdown",
        action="store_true",
        help="Say where the peak went: bytes by category (parameters, gradients, optimizer state, activations kept "
        "for backward, temporaries, other) and by module (the top-level children of each model the cell ran), and "
        "which phase (forward, backward, optimizer step) held it. Counts every operation while the cell runs, so the "
        "cell runs slower (see CudaMem.breakdown).",
    )
    @argument(
        "--nvtx",
        action="store_true",
        help="Wrap the cell in an NVTX range named In[n] and its first line, for Nsight Systems (see CudaMem.nvtx).",
    )
    @argument(
        "--no-reset-peak", action="store_true", help="Do not reset PyTorch's peak counters (see CudaMem.reset_peak)."
    )
    @no_var_expand  # the statement is the user's code: `{x}` and `$x` stay as written, as under %time
    @line_cell_magic
    @one_line_errors
    def cudamem(self, line: str, cell: str | None = None) -> Any:
        """Measure the GPU memory of a cell: peak and change, from PyTorch's allocator and NVML.

        Cell form::

            %%cudamem [options]
            model(x).sum().backward()

        Line form: ``%cudamem [options] STATEMENT``. Every-cell mode: ``%cudamem on`` prints one line after
        each cell that uses GPU memory, ``%cudamem off`` stops it, ``%cudamem status`` says which is active.
        Peak measurement resets PyTorch's peak counters (torch.cuda.reset_peak_memory_stats) at the start of
        the cell; pass --no-reset-peak or set ``%config CudaMem.reset_peak = False`` to keep them.
        """
        __tracebackhide__ = True  # noqa: F841
        if cell is None:
            options, statement = _split_options(line, _value_options(self.cudamem.parser))
            mode = self._mode(options, statement)
            if mode is not None:
                return self._every_cell(mode)
            if not statement:
                raise CudaMemError("nothing to measure: use %%cudamem as a cell magic, %cudamem STATEMENT, or %cudamem on")
            cell, line = statement, options
        args = self._parse_cudamem_options(self._expand_options(line))
        devices = None if args.device is None else list(parse_devices(args.device, option="--device"))
        meter = self._meter(devices, reset_peak=False if args.no_reset_peak else None)
        gpu_present = self._gpu_present()
        if gpu_present:
            meter.check_devices()
        limit_bytes = parse_size(args.limit) if args.limit else None
        breakdown = args.breakdown or self.breakdown
        needs_cuda = "limit" if limit_bytes else "trace" if args.trace else "breakdown" if breakdown else None
        if needs_cuda and self.hardware.allocator.status() is not None:
            raise CudaMemError(f"--{needs_cuda} needs PyTorch with a CUDA device: {self.hardware.allocator.status()}")
        report = self._measure(
            cell, meter, limit_bytes, args.trace, show=not args.quiet, breakdown=breakdown, nvtx=args.nvtx or self.nvtx
        )
        if report is None or args.output:
            return report
        if not args.quiet:
            display(report)
        return None

    def limit_of(self, source: str) -> int | None:
        """The ``--limit`` (bytes) a ``%%cudamem`` or ``%cudamem`` cell ran under; ``None`` for any other
        cell, or one whose options do not parse. ``%oomfix`` plans a failed cell under its cap."""
        text = source.lstrip()
        if text.startswith("%%cudamem"):
            line = text[len("%%cudamem"):].split("\n", 1)[0]
        elif text.startswith("%cudamem ") and "\n" not in text.strip():
            line, _ = _split_options(text[len("%cudamem"):].strip(), _value_options(self.cudamem.parser))
        else:
            return None
        try:
            args = self._parse_cudamem_options(self._expand_options(line.strip()))
            return parse_size(args.limit) if args.limit else None
        except (CudaMemError, Exception):  # noqa: BLE001  a header argparse rejects ran no cell
            return None

    def _expand_options(self, options: str) -> str:
        """``{x}`` and ``$x`` in the options (never in the code measured) expand from the user's namespace,
        as IPython expands a magic's line: ``%%cudamem --limit {cap}``. Left as written when they do not
        expand, as IPython leaves them."""
        if "{" not in options and "$" not in options:
            return options
        from IPython.utils.text import DollarFormatter

        try:
            return DollarFormatter().vformat(options, args=[], kwargs=dict(self.shell.user_ns))
        except Exception:
            return options

    def _mode(self, options: str, statement: str) -> str | None:
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
            if statement in self.shell.user_ns or hasattr(builtins, statement):
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
            defined = name in self.shell.user_ns or hasattr(builtins, name)
            if not _parses(statement) or not (defined or _assigns(statement, name)):
                raise CudaMemError(f"%cudamem {first} takes nothing after it: type %cudamem {first}")
        return None

    def _parse_cudamem_options(self, line: str) -> Any:
        """argparse costs ~80 µs a call; the same option line always parses the same way."""
        cached = self._parsed_options.get(line)
        if cached is None:
            cached = parse_argstring(self.cudamem, line)
            if len(self._parsed_options) < 256:
                self._parsed_options[line] = cached
        return argparse.Namespace(**vars(cached))

    def _measure(
        self, cell: str, meter: Meter, limit_bytes: int | None, trace: bool, show: bool = True,
        breakdown: bool = False, nvtx: bool = False,
    ) -> CellReport | None:
        """Run ``cell`` as a plain cell, measured; ``None`` when it failed (its error shown as a plain cell's).

        A body that does not compile gets no report: nothing ran. When reading the counters after a
        failed cell fails too (a sticky CUDA error makes ``synchronize()`` raise again), the user's
        error is still the one shown, after a one-line note.
        """
        __tracebackhide__ = True  # noqa: F841
        count = current_cell_number(self.shell)
        label = f"[{count}]"
        snapshot = self._snapshot()
        ran: Ran | None = None
        measurement: Measurement | None = None
        tracing: list[TraceSummary] | None = None
        tracker: Any = None
        try:
            with ExitStack() as stack:
                cap_note = stack.enter_context(self._capped(limit_bytes, meter.devices)) if limit_bytes else None
                tracing = stack.enter_context(self._tracing()) if trace else None
                if nvtx:
                    stack.enter_context(self._nvtx_range(count, cell))
                baseline = meter.start()
                self._inside_magic = True
                try:
                    if breakdown:
                        with self._tracker() as tracker:
                            ran = run_cell_body(self.shell, cell)
                    else:
                        ran = run_cell_body(self.shell, cell)
                finally:
                    self._inside_magic = False
                if ran.started:
                    error_name = None if ran.error is None else type(ran.error).__name__
                    measurement = meter.stop(baseline, error=error_name, limit_bytes=cap_note)
        except Exception as failure:
            if ran is None or ran.error is None:
                raise
            self.note(f"could not read GPU memory after the cell ({type(failure).__name__}: {failure}); your error follows")
            ran.fail(self.shell)
            return None
        if measurement is None:  # it did not compile: a plain cell's SyntaxError, nothing measured
            ran.fail(self.shell)
            return None
        traces = tuple(tracing or ())
        left = self._left_behind(measurement, snapshot, ran.value, ran.error)
        record = self._record(count, cell, measurement)
        breakdowns = self._breakdowns(tracker, measurement) if tracker is not None else ()
        report = CellReport(
            measurement, label=label, traces=traces, left=left, growth=record.growth, breakdowns=breakdowns
        )
        del left, snapshot, tracker
        ran.show_values(self.shell)
        if ran.error is not None:
            if show:
                display(report)
            ran.fail(self.shell)
            return None
        return report

    def _tracker(self) -> Any:
        """What counts the cell's tensors for --breakdown (imports torch: only when asked)."""
        if self.breakdown_tracker is not None:
            return self.breakdown_tracker(self.shell.user_ns)
        from ..sources.torch_breakdown import PeakTracker

        return PeakTracker(self.shell.user_ns)

    def _breakdowns(self, tracker: Any, measurement: Measurement) -> tuple[Any, ...]:
        """Where each measured device's peak went; a failure of ours costs the user only this part."""
        from ..breakdown import breakdowns_for

        peaks = {d.device.label: d.peak_allocated_bytes for d in measurement.devices if d.peak_allocated_bytes}
        start = {d.device.label: d.before.allocator.allocated_bytes for d in measurement.devices if d.before.allocator}
        try:
            return breakdowns_for(peaks, tracker.peaks(), start)
        except Exception as failure:  # noqa: BLE001  a bug of ours must not cost the user the report
            self.note(f"could not break the peak down: {type(failure).__name__}: {failure}")
            return ()

    def _nvtx_range(self, count: int | None, cell: str) -> Any:
        from ..sources.nvtx import TorchNvtx, range_name

        ranges = self.nvtx_ranges if self.nvtx_ranges is not None else TorchNvtx()
        return ranges.range(range_name(count, cell))

    @contextmanager
    def _capped(self, limit_bytes: int, devices: list[int] | None) -> Iterator[int]:
        """Cap PyTorch at ``limit_bytes`` minus what the process holds outside it, then restore the cap."""
        allocator = self.hardware.allocator
        indexes = devices if devices is not None else list(range(allocator.device_count()))
        allocator.empty_cache()  # cached blocks from earlier cells would count against the cap
        previous: dict[int, float] = {}
        try:
            for index in indexes:
                total = allocator.device(index).total_bytes
                if limit_bytes > total:
                    raise CudaMemError(
                        f"--limit {format_bytes(limit_bytes)} is more than cuda:{index} has ({format_bytes(total)}): "
                        "a cap can only play a smaller card"
                    )
                previous[index] = allocator.memory_fraction(index) or 1.0
                allocator.set_memory_fraction(index, limit_bytes / total)
            yield limit_bytes
        finally:
            for index, fraction in previous.items():
                allocator.set_memory_fraction(index, fraction)

    @contextmanager
    def _tracing(self) -> Iterator[list[TraceSummary]]:
        allocator = self.hardware.allocator
        summaries: list[TraceSummary] = []
        allocator.start_trace(self.trace_max_entries)
        try:
            yield summaries
        finally:
            snapshot = allocator.stop_trace()
            directory = Path(self.trace_dir)
            count = current_cell_number(self.shell)
            path = save_snapshot(snapshot, directory / f"cell{count}-{time.strftime('%Y%m%d-%H%M%S')}.pickle")
            cell_name = f"In[{count}]"
            for index, events in enumerate(snapshot.get("device_traces") or []):
                if not events:
                    continue
                summary = summarize(
                    snapshot,
                    index,
                    describe_file=self._describe_file,
                    source_line=lambda f, n: linecache.getline(f, n) or None,
                    is_cell_file=lambda f: self._describe_file(f) == cell_name,
                )
                summaries.append(
                    TraceSummary(
                        summary.device_index, summary.traced_peak_bytes, summary.sites, str(path), summary.events,
                        summary.growth,
                    )
                )

    # -- every-cell mode -------------------------------------------------------------------
    def _every_cell(self, command: str) -> None:
        events = self.shell.events
        if command == "on" and not self._auto_on:
            events.register("pre_run_cell", self._pre_run_cell)
            events.register("post_run_cell", self._post_run_cell)
            self._auto_on = True
        elif command == "off" and self._auto_on:
            self._stop_every_cell()
            self._cell_depth = 0
        threshold = format_bytes(self._threshold_bytes())
        state = f"on: a line after each cell that moves GPU memory by {threshold} or more" if self._auto_on else "off"
        print(f"cudamem every-cell mode {state}")
        if self._auto_on and not self._gpu_present():
            self.note("no GPU measured here: " + "; ".join(self.hardware.unavailable()))

    def _stop_every_cell(self) -> None:
        events = self.shell.events
        for name, callback in (("pre_run_cell", self._pre_run_cell), ("post_run_cell", self._post_run_cell)):
            try:
                events.unregister(name, callback)
            except ValueError:
                pass
        self._auto_on = False
        self._auto_baseline = None

    def _threshold_bytes(self) -> int:
        threshold = self.auto_threshold
        if threshold != self._threshold_text:  # parsed once per setting, not once per cell
            self._threshold_value = size_setting("CudaMem.auto_threshold", threshold, _AUTO_ALLOWED) or 0
            self._threshold_text = threshold
        return self._threshold_value

    def _pre_run_cell(self, info: Any = None) -> None:
        # A cell may run others (%oomfix reruns through shell.run_cell): those nested cells belong
        # to the outer one's measurement, so only the outermost cell is measured.
        self._cell_depth += 1
        if self._cell_depth > 1:
            return
        raw = getattr(info, "raw_cell", "") or ""
        if self._inside_magic or raw.lstrip().startswith(("%%cudamem", "%cudamem")):
            self._auto_baseline = None
            return
        try:
            snapshot = self._snapshot()
            meter = self._meter()
            self._auto_baseline = (meter, meter.start(), raw, snapshot)
        except Exception as error:  # never break the user's cell because a reading failed
            self._auto_baseline = None
            self.note(f"every-cell measurement skipped: {error}")

    def _post_run_cell(self, result: Any = None) -> None:
        raw = getattr(getattr(result, "info", None), "raw_cell", None)
        if raw is not None and not raw.strip():
            return  # IPython skips pre_run_cell for a blank cell but still sends post_run_cell
        self._cell_depth = max(self._cell_depth - 1, 0)
        if self._cell_depth > 0:
            return
        pending, self._auto_baseline = self._auto_baseline, None
        if pending is None or self._inside_magic:
            return
        meter, baseline, raw, snapshot = pending
        try:
            failure = getattr(result, "error_in_exec", None) or getattr(result, "error_before_exec", None)
            measurement = meter.stop(baseline, error=None if failure is None else type(failure).__name__)
            # IPython before 9.8 gives no number to a cell run with store_history=False (silent runs, tests).
            count = getattr(result, "execution_count", None)
            if count is None:
                count = current_cell_number(self.shell)
            del failure  # the traceback is IPython's to keep, not ours
            left = self._left_behind(measurement, snapshot)
            record = self._record(count, raw, measurement)
            if self._worth_a_line(measurement):
                print(one_line(measurement, f"[{count}]" if count is not None else ""))
                if left is not None:
                    print("  " + left_summary(left))
                    for holder in left.leaks:
                        print(f"    → {holder.name}: {holder.advice[0]}")
                if record.growth is not None:
                    print(f"  {record.growth.describe()}")
        except Exception as error:
            self.note(f"every-cell measurement failed: {error}")

    def _worth_a_line(self, measurement: Any) -> bool:
        if measurement.error == "OutOfMemoryError":
            return True
        if not measurement.devices:
            return False
        threshold = self._threshold_bytes()
        for device in measurement.devices:
            for value in (
                device.peak_above_start_bytes,
                device.allocated_delta_bytes,
                device.reserved_delta_bytes,
                device.nvml_used_delta_bytes,
            ):
                if value is not None and abs(value) >= threshold:
                    return True
        return False

    # -- %cudamem_history ------------------------------------------------------------------
    @magic_arguments()
    @argument("--plot", action="store_true", help="Show a chart of each cell's peak and what it left (matplotlib).")
    @argument(
        "--save",
        metavar="FILE",
        help="Write the selected records to FILE (.csv or .json) and say so in one line; with --plot, the chart "
        "(.png, .svg or .pdf).",
    )
    @argument("--all", action="store_true", help=f"List every selected cell, not the latest {DEFAULT_SHOWN_CELLS} and a summary.")
    @argument("--last", type=int, metavar="N", help="Only the latest N measured cells.")
    @argument(
        "--cells",
        metavar="RANGES",
        help="Only these cells, numbered as In [N]: 12, 5-9 (both included), 20- (from 20 on); several "
        "separated by commas.",
    )
    @argument("--clear", action="store_true", help="Forget all measured cells.")
    @argument("-o", "--output", action="store_true", help="Return the records (a list of dicts for pandas.DataFrame).")
    @line_magic
    @one_line_errors
    def cudamem_history(self, line: str = "") -> Any:
        """Show the cells measured so far: a table, a plot, or records to load into pandas.

        The table lists the latest cells and sums up the rest in one line (--all lists every cell); the plot
        keeps one size and bins what the screen cannot tell apart. --last and --cells pick the cells for
        every view, --save and -o included. ``pandas.DataFrame(%cudamem_history -o)`` gives one row per cell
        and device, sizes in bytes.
        """
        args = parse_argstring(self.cudamem_history, line)
        if args.clear:
            count = len(self.history)
            self.history.clear()
            print(f"cudamem history cleared ({count:,} cells)")
            return None
        records = self.history.select(cells=args.cells, last=args.last)
        if not records and args.cells is not None and len(self.history):
            # The history is not empty: the selection missed it. Say what it holds, not "empty".
            numbers = [n for n in (r.execution_count for r in self.history.select()) if n is not None]
            held = f", [{min(numbers)}] to [{max(numbers)}]" if numbers else ""
            raise CudaMemError(f"no measured cell in --cells {args.cells.strip()}; the history holds "
                               f"{len(self.history):,} cells{held}")
        if args.plot:
            plot = HistoryPlot(records)
            if args.save:
                print(_saved(args.save, plot.save))
            display(plot)
            return None
        if args.save:
            print(_saved(args.save, lambda path: save_records(records, path)))
        if args.output:
            return flat_rows(records)
        if not args.save:
            display(HistoryTable(records, shown=None if args.all else DEFAULT_SHOWN_CELLS))
        return None

    def close(self) -> None:
        if self._auto_on:
            self._stop_every_cell()
