"""``%%cudamem_plan``: which card does this cell need, at which batch? (``jupyter_cudamem.capacity``)

Thin: parses the options, hands ``capacity.planner`` a way to run the cell through the shell (like a plain
cell) and to keep the runs quiet, and shows its plan; a cell's own error is shown as a plain cell shows it. The card
table is extended with ``%config CudaMem.cards = {...}``; the margin defaults to
``%config CudaMemPlan.margin``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from IPython.core.magic import cell_magic, magics_class, no_var_expand
from IPython.core.magic_arguments import argument, magic_arguments
from traitlets import TraitError, validate

from ..capacity.plan import CALIBRATED_MARGIN, DEFAULT_MARGIN, CapacityPlan
from ..growth.fitting import REPLAY_MARGIN
from .base import CudaMemMagicsBase, current_cell_number, one_line_errors
from .cellrun import NO_VALUE, BodyRuns, run_cell_body
from .options import count_option, Float, number_option, parse_line

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.utils.bunch import Bunch

    from . import Extension
    from ..hardware import Hardware
    from .cudamem import CudaMem


@magics_class
class CudaMemPlan(CudaMemMagicsBase):
    """The capacity plan. Configure with ``%config CudaMemPlan.margin = 0.05``."""

    margin = Float(
        DEFAULT_MARGIN,
        help=f"How cautious a plan is: above the default {DEFAULT_MARGIN:g}, each request the allocator's replay "
        f"plays is taken that much larger besides its own {REPLAY_MARGIN:.0%}; where the runs could not be "
        "recorded, the fraction of each card's room above the fixed part left free. --margin overrides it for one "
        "plan.",
    ).tag(config=True)

    calibrated_margin = Float(
        CALIBRATED_MARGIN,
        help="The margin of a plan made with --calibrate, whose measured ratio already holds the allocator's "
        "rounding and waste: what is left is another card's driver share and the ratio's drift with scale. "
        "--margin overrides it for one plan.",
    ).tag(config=True)

    def __init__(self, shell: InteractiveShell, hardware: Hardware, extension: Extension, **kwargs: object):
        super().__init__(shell=shell, hardware=hardware, extension=extension, **kwargs)
        self.last_plan: CapacityPlan | None = None

    @validate("margin", "calibrated_margin")
    def _check_margin(self, proposal: Bunch) -> float:
        value = proposal["value"]
        if not 0.0 <= value < 1.0:
            example = CALIBRATED_MARGIN if proposal["trait"].name == "calibrated_margin" else DEFAULT_MARGIN
            raise TraitError(f"CudaMemPlan.{proposal['trait'].name} takes a fraction from 0 up to (not including) 1, "
                             f"such as {example:g}; got {value!r}")
        return value

    @magic_arguments("%cudamem_plan")  # the usage line is "%" + this name: %%cudamem_plan, as it is typed
    @argument("--autocast", action="store_true",
              help="Also run the cell at its batch under torch.autocast, to say what bfloat16/float16 buys.")
    @argument("--margin", type=number_option("a fraction"), default=None, metavar="FRACTION",
              help=f"How cautious the plan is (default {DEFAULT_MARGIN}, or CudaMemPlan.margin; with --calibrate "
              f"{CALIBRATED_MARGIN}, or CudaMemPlan.calibrated_margin): see CudaMemPlan.margin.")
    @argument("--cards", default=None, metavar="NAME,NAME",
              help="Plan for these cards of the table only (add cards with %%config CudaMem.cards = {...}).")
    @argument("-o", "--output", action="store_true",
              help="Return the plan, as %%timeit -o does: it is the cell's Out[N], shown once as any value is, so "
              "plan = _ (or Out[N]) in the next cell keeps it (.predicted, .cards, .line, .figure()).")
    @argument("--small", type=count_option("the second batch size to measure"), default=None, metavar="N",
              help="The second batch to measure, 1 or more (default: half the batch as written).")
    @argument("--calibrate", action="store_true",
              help="Also find the largest batch that fits on the smallest card of the plan (PyTorch capped here to "
              "play it; this card when none is smaller) by running the cell there, up to 12 more runs at batches "
              "that fill it, and scale the line by what that memory really took: the allocator's waste and the "
              "workspaces libraries skip under a cap, which two runs cannot see.")
    @no_var_expand
    @cell_magic("cudamem_plan")  # type: ignore[arg-type]  # IPython annotates cell_magic("name") as taking Never
    @one_line_errors
    def cudamem_plan(self, line: str, cell: str) -> CapacityPlan | None:
        """Run the cell at its batch and at a smaller one, fit peak = fixed + per sample x batch, and say
        for this card and a table of common cards the largest batch that fits, and for the batch as
        written: fits, or a micro-batch and the gradient-accumulation steps that keep it exactly.

        The batch is found and changed as %oomfix does it, and put back; the cell runs last at its own
        batch, so the namespace is as after a normal run, and the model, optimizer and the lists and
        counters it changes are put back as its first run left them (one run's steps and entries). A
        cell with no batch runs once and is planned as fixed-size. The memory outside PyTorch (CUDA context, library workspaces) is measured here
        through NVML.
        """
        __tracebackhide__ = True  # noqa: F841
        from IPython.display import display
        from IPython.utils.capture import capture_output

        from ..capacity.cards import card_table, select_cards
        from ..capacity.planner import CellAccess, PlanOptions, plan_cell
        from ..ipython_state import input_history

        args = parse_line(self.cudamem_plan, line)
        options = PlanOptions(select_cards(card_table(self._cards_setting()), args.cards), self.margin,
                              self.calibrated_margin, args.margin, args.autocast, args.small, args.calibrate)
        reason = self.hardware.allocator.status()
        if reason is not None:
            # As every magic of ours without a GPU: the body runs as a plain cell, and this says what is missing.
            self.note(f"%%cudamem_plan cannot measure here ({reason}): no plan; the cell runs as a plain cell")
            plain = run_cell_body(self.shell, cell)
            plain.show_values(self.shell)
            plain.fail(self.shell)
            return None

        shell: InteractiveShell = self.shell
        body = BodyRuns(shell)
        access = CellAccess(shell.user_ns, shell.transform_cell, input_history(shell), current_cell_number(shell),
                            run=body.run, quiet=capture_output)
        cudamem = self._cudamem()
        try:
            plan, measured = plan_cell(cell, options, access, self.hardware,
                                       cudamem.history.records if cudamem is not None else ())
        except BaseException as error:
            failed = body.failure(error)
            if failed is None:
                raise  # ours (one line) or an interrupt outside the body
            del error
            failed.fail(shell)  # the cell's own error, shown as a plain cell shows it: no plan
            return None
        self.last_plan = plan
        if measured.has_value and measured.value is not NO_VALUE:
            shell.displayhook(measured.value)  # the cell's value first, as %%cudamem shows it
        if args.output:
            return plan  # shown once, as the cell's Out[N] (displayed as well, it would show twice)
        display(plan)
        return None

    def _cudamem(self) -> CudaMem | None:
        from .cudamem import CudaMem

        return self.extension.get(CudaMem)

    def _cards_setting(self) -> dict[str, object]:
        cudamem = self._cudamem()
        return dict(cudamem.cards) if cudamem is not None else {}
