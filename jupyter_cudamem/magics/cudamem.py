"""``%%cudamem`` and ``%cudamem`` (a statement, or ``on``/``off`` for every cell).

Thin: the option line is ``cudamem_arguments``'s, the every-cell mode ``every_cell``'s, ``%cudamem_history``
is ``history.CudaMemHistory``; running a cell measured is ``measured_cell``'s, who holds what a cell left
``left_attribution``'s. This class holds the settings (``%config CudaMem...``), read into one
``measuring.CellSettings`` as each cell starts and handed to those helpers with the shell, the hardware and
the history of measured cells (they never hold this class), and the magic itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from IPython.core.magic import line_cell_magic, magics_class, no_var_expand
from IPython.core.magic_arguments import argument, magic_arguments
from traitlets import All, Bool, Dict, Int, TraitError, Unicode, Union, observe, validate

from ..attribution.left import DEFAULT_THRESHOLD_BYTES
from ..errors import CudaMemError
from ..history import History
from ..units import MiB, parse_size
from .base import CudaMemMagicsBase, one_line_errors, parse_devices, show_report
from .cellrun import NO_VALUE
from .cudamem_arguments import CudaMemArguments
from .every_cell import EveryCell, mode_of
from .left_attribution import LeftAttribution
from .measured_cell import CellMeasurer
from .measuring import (
    ATTRIBUTE_ALLOWED, AUTO_ALLOWED, AUTO_OFF, CellSettings, attribute_threshold_bytes, auto_threshold_bytes, gpu_present,
)
from .options import positive_int, size_setting

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.utils.bunch import Bunch

    from ..attribution.probe import TensorProbe
    from ..hardware import Hardware
    from . import Extension
    from .measuring import NvtxRanges, PeakCounter


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
        default_value=f"{DEFAULT_THRESHOLD_BYTES // MiB}MiB",
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
    verbose = Bool(
        False, help="Show everything under a %%cudamem report's three first lines, as --verbose does: each device's "
        "figures, who holds what the cell left, where the peak went, hints and notes.",
    ).tag(config=True)
    nvtx = Bool(
        False,
        help="Wrap each %%cudamem cell in an NVTX range named after it (In[n] and its first line), as --nvtx does, so "
        "an Nsight Systems timeline shows cells.",
    ).tag(config=True)

    # Every option is checked when it is set (``%config`` prints the one line) and applies from the
    # next cell on; history_size resizes the history at once.
    @validate("auto_threshold")
    def _check_auto_threshold(self, proposal: Bunch) -> int | str:
        size_setting("CudaMem.auto_threshold", proposal["value"], AUTO_ALLOWED, off_words=AUTO_OFF)
        return proposal["value"]

    @validate("attribute_threshold")
    def _check_attribute_threshold(self, proposal: Bunch) -> int | str:
        size_setting("CudaMem.attribute_threshold", proposal["value"], ATTRIBUTE_ALLOWED)
        return proposal["value"]

    @validate("history_size")
    def _check_history_size(self, proposal: Bunch) -> int:
        return positive_int("CudaMem.history_size", proposal["value"], "the number of measured cells kept")

    @validate("trace_max_entries")
    def _check_trace_max_entries(self, proposal: Bunch) -> int:
        return positive_int("CudaMem.trace_max_entries", proposal["value"], "the most allocation events --trace records")

    @validate("cards")
    def _check_cards(self, proposal: Bunch) -> dict[str, object]:
        from ..capacity.cards import card_table

        try:
            card_table(proposal["value"])  # the same check %%cudamem_plan makes, now, when it is set
        except CudaMemError as error:
            raise TraitError(str(error)) from None
        return proposal["value"]

    @validate("trace_dir")
    def _check_trace_dir(self, proposal: Bunch) -> str:
        if not proposal["value"].strip():
            raise TraitError("CudaMem.trace_dir takes a folder for --trace's snapshots, such as 'cudamem_traces'; got ''")
        return proposal["value"]

    @observe("history_size")
    def _resize_history(self, change: Bunch) -> None:
        history = getattr(self, "history", None)
        if history is not None:
            history.max_records = change["new"]

    _settings: CellSettings | None = None  # kept from cell to cell (``settings``)

    @observe(All)
    def _settings_changed(self, change: object) -> None:
        self._settings = None  # read again at the next cell: traitlets cost ~1 µs a trait, on every cell

    def __init__(self, shell: InteractiveShell, hardware: Hardware, extension: Extension, **kwargs: object):
        super().__init__(shell, hardware, extension, **kwargs)
        self.history = History(self.history_size)
        self.attribution = LeftAttribution(shell, hardware)
        self.every_cell = EveryCell(shell, hardware, self.attribution, self.history, self.settings, extension.cell_starts)
        self.measurer = CellMeasurer(shell, hardware, self.attribution, self.history, self.every_cell,
                                     extension.cell_starts)
        self.arguments = CudaMemArguments(self.cudamem.parser)
        # How tensors are recognised (``attribution.TensorProbe``); ``None`` means PyTorch's types.
        self.probe: TensorProbe | None = None
        # What --breakdown counts with: ``namespace -> tracker`` (``sources.torch_breakdown.PeakTracker``
        # of CUDA tensors when ``None``); and what --nvtx marks with (``sources.nvtx.TorchNvtx``).
        self.breakdown_tracker: Callable[[Mapping[str, object]], PeakCounter] | None = None
        self.nvtx_ranges: NvtxRanges | None = None

    def settings(self) -> CellSettings:
        """The settings as a cell starts, read once for the helpers that measure it (and kept until a
        setting changes: the traits through ``_settings_changed``, the plain attributes by identity)."""
        kept = self._settings
        if (kept is not None and kept.probe is self.probe and kept.breakdown_tracker is self.breakdown_tracker
                and kept.nvtx_ranges is self.nvtx_ranges):
            return kept
        kept = self._settings = CellSettings(
            reset_peak=self.reset_peak,
            process_memory=self.process_memory,
            auto_threshold_bytes=auto_threshold_bytes(self.auto_threshold),
            attribute_threshold_bytes=attribute_threshold_bytes(self.attribute_threshold),
            trace_dir=self.trace_dir,
            trace_max_entries=self.trace_max_entries,
            probe=self.probe,
            breakdown_tracker=self.breakdown_tracker,
            nvtx_ranges=self.nvtx_ranges,
        )
        return kept

    # -- %%cudamem / %cudamem ------------------------------------------------------------------
    @magic_arguments()
    @argument("-d", "--device", help="CUDA device(s) to report, e.g. 0 or 0,1 (default: every device the cell touched).")
    @argument("-q", "--quiet", action="store_true", help="Record in the history but show no report.")
    @argument(
        "-o",
        "--output",
        action="store_true",
        help="Show the report and also return it, as %%timeit -o does: report = %%cudamem -o STATEMENT (with -q, "
        "return it only). The every-cell mode's on, off and status return nothing.",
    )
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
        "-v",
        "--verbose",
        action="store_true",
        help="Show everything under the three first lines: each device's figures, who holds what the cell left, "
        "where the peak went, hints and notes (default: CudaMem.verbose; in HTML they are one click away).",
    )
    @argument(
        "--no-reset-peak", action="store_true", help="Do not reset PyTorch's peak counters (see CudaMem.reset_peak)."
    )
    @no_var_expand  # the statement is the user's code: `{x}` and `$x` stay as written, as under %time
    @line_cell_magic
    @one_line_errors
    def cudamem(self, line: str, cell: str | None = None) -> object:
        """Measure the GPU memory of a cell: peak and change, from PyTorch's allocator and NVML.

        Cell form::

            %%cudamem [options]
            model(x).sum().backward()

        Line form: ``%cudamem [options] STATEMENT``, which returns the statement's value as ``%time`` does
        (``y = %cudamem f(x)``); a statement that starts with ``-`` goes in parentheses (``%cudamem (-x)``),
        where it would read as an option. Every-cell mode: ``%cudamem on`` prints one line after
        each cell that uses GPU memory, ``%cudamem off`` stops it, ``%cudamem status`` says which is active.
        Peak measurement resets PyTorch's peak counters (torch.cuda.reset_peak_memory_stats) at the start of
        the cell; pass --no-reset-peak or set ``%config CudaMem.reset_peak = False`` to keep them.
        """
        __tracebackhide__ = True  # noqa: F841
        line_form = cell is None
        if cell is None:
            options, statement = self.arguments.split(line)
            mode = mode_of(options, statement, self.shell.user_ns)
            if mode is not None:
                self.every_cell.switch(mode)
                return None
            args = self.arguments.parse(options, self.shell.user_ns, line_form=True)  # an unknown option first
            if not statement:
                raise CudaMemError("nothing to measure: use %%cudamem as a cell magic, %cudamem STATEMENT, or %cudamem on")
            cell = statement
        else:
            args = self.arguments.parse(line, self.shell.user_ns)
        settings = self.settings()
        devices = None if args.device is None else list(parse_devices(args.device, option="--device"))
        meter = settings.meter(self.hardware, devices, reset_peak=False if args.no_reset_peak else None)
        if gpu_present(self.hardware):
            meter.check_devices()
        limit_bytes = parse_size(args.limit) if args.limit else None
        breakdown, nvtx = args.breakdown or self.breakdown, args.nvtx or self.nvtx
        # As every magic of ours without a GPU: the body runs, and one line says what it runs without, named
        # as the user asked for it (the flag typed, else the setting).
        allocator = self.hardware.allocator.status()
        wanted = {  # name: (asked for, why it cannot run here)
            "--limit": (bool(limit_bytes), allocator),
            "--trace": (args.trace, allocator),
            "--breakdown" if args.breakdown else "CudaMem.breakdown": (breakdown, allocator),
            "--nvtx" if args.nvtx else "CudaMem.nvtx": (nvtx, self._nvtx_status() if nvtx else None),
        }
        without = {name: reason for name, (on, reason) in wanted.items() if on and reason is not None}
        if without:
            names, one = " and ".join(without), len(without) == 1
            self.note(f"{names} need{'s' if one else ''} PyTorch with a CUDA device ({next(iter(without.values()))}); "
                      f"the cell runs without {'it' if one else 'them'}")
        # The line form returns the statement's value, as %time does (-o returns the report: the value shows).
        returns_value = line_form and not args.output
        measured = self.measurer.measure(
            cell, settings, meter, limit_bytes if allocator is None else None, args.trace and allocator is None,
            show=not args.quiet, breakdown=breakdown and allocator is None,
            nvtx=nvtx and not without.keys() & {"--nvtx", "CudaMem.nvtx"}, verbose=args.verbose or self.verbose,
            show_values=not returns_value,
        )
        if measured is None:
            return None
        if not args.quiet:
            show_report(self.shell, measured.report)
        if args.output:
            return measured.report
        return measured.value if returns_value and measured.value is not NO_VALUE else None

    def _nvtx_status(self) -> str | None:
        """Why no NVTX range can be pushed (``None``: one can), from what --nvtx marks with."""
        if self.nvtx_ranges is not None:
            status = getattr(self.nvtx_ranges, "status", None)
            return status() if status is not None else None
        from ..sources.nvtx import TorchNvtx

        return TorchNvtx().status()

    def limit_of(self, source: str) -> int | None:
        """The ``--limit`` (bytes) a ``%%cudamem`` or ``%cudamem`` cell ran under; ``None`` for any other
        cell, or one whose options do not parse. ``%oomfix`` plans a failed cell under its cap."""
        return self.arguments.limit_of(source, self.shell.user_ns)

    def close(self) -> None:
        if self.every_cell.on:
            self.every_cell.stop()
        self.attribution.close()
