"""``%cudamem_history``: the cells ``%%cudamem`` and the every-cell mode measured, as a table, a plot or records.

The records are ``CudaMem``'s (``CudaMem.history``, sized by ``%config CudaMem.history_size``); this class
only shows them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from IPython.core.magic import line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import display

from ..errors import CudaMemError
from ..history import History, flat_rows, save_records
from ..report import HistoryTable
from ..report.plot import HistoryPlot
from ..report.table import DEFAULT_SHOWN_CELLS
from .base import CudaMemMagicsBase, one_line_errors
from .options import count_option, parse_line

T = TypeVar("T")


def _saved(path: str, save: Callable[[Path], T]) -> T:
    """``--save PATH`` for records and plots alike: missing folders are created; a path that cannot be
    written is one line."""
    target = Path(path).expanduser()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        return save(target)
    except OSError as error:
        reason = _not_a_folder(target) or error.strerror or type(error).__name__
        raise CudaMemError(f"cannot write {str(target)!r}: {reason}; choose --save a path you can write") from None


def _not_a_folder(target: Path) -> str | None:
    """Where the nearest existing folder on the way to ``target`` is a file (``/dev/null/x.csv``): the OS's
    own words for it ("File exists", "Not a directory") do not say which."""
    for folder in target.parents:
        if os.path.isdir(folder):
            return None
        if os.path.lexists(folder):
            return f"{str(folder)!r} is not a folder"
    return None


@magics_class
class CudaMemHistory(CudaMemMagicsBase):
    """The history of measured cells (kept by ``CudaMem``)."""

    def _history(self) -> History:
        from .cudamem import CudaMem

        cudamem = self.extension.get(CudaMem)
        if not isinstance(cudamem, CudaMem):
            raise CudaMemError("%cudamem_history needs %%cudamem loaded: run %load_ext jupyter_cudamem")
        return cudamem.history

    @magic_arguments()
    @argument("--plot", action="store_true", help="Show a chart of each cell's peak and what it left (matplotlib).")
    @argument(
        "--save",
        metavar="FILE",
        help="Write the selected records to FILE (.csv or .json) and say so in one line; with --plot, the chart "
        "(.png, .svg or .pdf).",
    )
    @argument("--all", action="store_true", help=f"List every selected cell, not the latest {DEFAULT_SHOWN_CELLS} and a summary.")
    @argument("--last", type=count_option("a number of cells"), metavar="N", help="Only the latest N measured cells.")
    @argument(
        "--cells",
        metavar="RANGES",
        help="Only these cells, numbered as In [N]: 12, 5-9 (both included), 20- (from 20 on); several "
        "separated by commas.",
    )
    @argument("--clear", action="store_true", help="Forget all measured cells.")
    @argument(
        "-o",
        "--output",
        action="store_true",
        help="Show the table (or the plot, or the line --save prints) and also return the selected records, as "
        "%%timeit -o does: rows = %%cudamem_history -o, one dict per cell and device for pandas.DataFrame. --clear "
        "returns nothing.",
    )
    @line_magic
    @one_line_errors
    def cudamem_history(self, line: str = "") -> list[dict[str, str | int | float | None]] | None:
        """Show the cells measured so far: a table, a plot, or records to load into pandas.

        The table lists the latest cells and sums up the rest in one line (--all lists every cell); the plot
        keeps one size and bins what the screen cannot tell apart. --last and --cells pick the cells for
        every view, --save and -o included. ``rows = %cudamem_history -o`` shows the table and returns the
        records: ``pandas.DataFrame(rows)`` gives one row per cell and device, sizes in bytes.
        """
        args = parse_line(self.cudamem_history, line)
        if args.save is not None and not args.save.strip():
            raise CudaMemError("--save takes a file to write, such as cells.csv (with --plot, cells.png); got an "
                               "empty path")
        history = self._history()
        if args.clear:
            others = [flag for flag, given in (("--last", args.last is not None), ("--cells", args.cells is not None),
                                               ("--plot", args.plot), ("--save", args.save is not None),
                                               ("--all", args.all)) if given]
            if others:
                raise CudaMemError(f"--clear forgets every measured cell: it takes no {others[0]} (nothing was "
                                   "cleared)")
            count = len(history)
            history.clear()
            print(f"cudamem history cleared ({count:,} cells)")
            return None
        records = history.select(cells=args.cells, last=args.last)
        if not records and args.cells is not None and len(history):
            # The history is not empty: the selection missed it. Say what it holds, not "empty".
            numbers = [n for n in (r.execution_count for r in history.select()) if n is not None]
            held = f", [{min(numbers)}] to [{max(numbers)}]" if numbers else ""
            raise CudaMemError(f"no measured cell in --cells {args.cells.strip()}; the history holds "
                               f"{len(history):,} cells{held}")
        if args.plot:
            plot = HistoryPlot(records)
            if args.save:
                print(_saved(args.save, plot.save))
            display(plot)
        elif args.save:
            print(_saved(args.save, lambda path: save_records(records, path)))
        else:
            display(HistoryTable(records, shown=None if args.all else DEFAULT_SHOWN_CELLS))
        return flat_rows(records) if args.output else None
