"""``%%cudamem_plan``: which card does this cell need, at which batch? (``jupyter_cudamem.capacity``)

Thin: finds the batch with the finder ``%oomfix`` uses, hands the runs to ``capacity.runs`` (which
runs the cell through the shell, like a plain cell), and shows ``capacity.plan``'s plan. The card
table is extended with ``%config CudaMem.cards = {...}``; the margin defaults to
``%config CudaMemPlan.margin``.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

from IPython.core.magic import cell_magic, magics_class, no_var_expand
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from traitlets import Float

from ..capacity.plan import CALIBRATED_MARGIN, DEFAULT_MARGIN
from ..errors import CudaMemError
from ..units import GiB
from .base import CudaMemMagicsBase, current_cell_number, one_line_errors
from .cellrun import NO_VALUE, BodyRuns, run_cell_body
from ..oomfix.leftovers import set_aside
from ..sources.torch_host import TorchMover


@magics_class
class CudaMemPlan(CudaMemMagicsBase):
    """The capacity plan. Configure with ``%config CudaMemPlan.margin = 0.05``."""

    margin = Float(
        DEFAULT_MARGIN,
        help="Fraction of the memory PyTorch may use on a card that the plan leaves free (the allocator's "
        "rounding, the driver's share). --margin overrides it for one plan.",
    ).tag(config=True)

    calibrated_margin = Float(
        CALIBRATED_MARGIN,
        help="The margin of a plan made with --calibrate, whose measured ratio already holds the allocator's "
        "rounding and waste: what is left is another card's driver share and the ratio's drift with scale. "
        "--margin overrides it for one plan.",
    ).tag(config=True)

    def __init__(self, shell: Any, hardware: Any, extension: Any = None, **kwargs: Any):
        super().__init__(shell=shell, hardware=hardware, extension=extension, **kwargs)
        self.last_plan: Any = None

    @magic_arguments()
    @argument("--autocast", action="store_true",
              help="Also run the cell at its batch under torch.autocast, to say what bfloat16/float16 buys.")
    @argument("--margin", type=float, default=None, metavar="FRACTION",
              help=f"Fraction of each card's memory for PyTorch left free (default {DEFAULT_MARGIN}, "
              f"or CudaMemPlan.margin; with --calibrate {CALIBRATED_MARGIN}, or CudaMemPlan.calibrated_margin).")
    @argument("--cards", default=None, metavar="NAME,NAME",
              help="Plan for these cards of the table only (add cards with %%config CudaMem.cards = {...}).")
    @argument("-o", "--output", action="store_true",
              help="Show the plan and also return it, as %%timeit -o does: it is the cell's Out[N], so plan = _ in the "
              "next cell keeps it (.predicted, .cards, .line, .figure()).")
    @argument("--small", type=int, default=None, metavar="N",
              help="The second batch to measure (default: half the batch as written).")
    @argument("--calibrate", action="store_true",
              help="Also find the largest batch that fits on the smallest card of the plan (PyTorch capped here to "
              "play it; this card when none is smaller) by running the cell there, up to 12 more runs at batches "
              "that fill it, and scale the line by what that memory really took: the allocator's waste and the "
              "workspaces libraries skip under a cap, which two runs cannot see.")
    @no_var_expand
    @cell_magic("cudamem_plan")  # type: ignore[arg-type]  # IPython annotates cell_magic("name") as taking Never
    @one_line_errors
    def cudamem_plan(self, line: str, cell: str) -> Any:
        """Run the cell at its batch and at a smaller one, fit peak = fixed + per sample x batch, and say
        for this card and a table of common cards the largest batch that fits, and for the batch as
        written: fits, or a micro-batch and the gradient-accumulation steps that keep it exactly.

        The batch is found and changed as %oomfix does it, and put back; the cell runs last at its own
        batch, so the namespace is as after a normal run. A cell with no batch runs once and is planned
        as fixed-size. The memory outside PyTorch (CUDA context, library workspaces) is measured here
        through NVML.
        """
        __tracebackhide__ = True  # noqa: F841
        from IPython.display import display
        from IPython.utils.capture import capture_output

        from ..batch import BatchChange, find_batch
        from ..capacity.cards import card_table, select_cards
        from ..capacity.plan import build_plan
        from ..capacity.runs import Runner, history_match, judge, measure_runs
        from ..cell.edit import AutocastNotApplicable, wrap_in_autocast
        from ..cell.traits import cell_traits
        from ..measure import Meter
        from ..ipython_state import input_history
        from ..oom import is_cuda_oom
        from ..repeats import source_key

        args = parse_argstring(self.cudamem_plan, line)
        margin = self.margin if args.margin is None else args.margin
        if not 0 <= margin < 1:
            raise CudaMemError(f"--margin takes a fraction from 0 to 1 such as 0.05, got {margin}")
        if args.calibrate and not 0 <= self.calibrated_margin < 1:
            raise CudaMemError(
                f"CudaMemPlan.calibrated_margin takes a fraction from 0 to 1 such as 0.03, got {self.calibrated_margin}: "
                "set it with %config CudaMemPlan.calibrated_margin = 0.03"
            )
        cards = select_cards(card_table(self._cards_setting()), args.cards)
        reason = self.hardware.allocator.status()
        if reason is not None:
            # As every magic of ours without a GPU: the body runs as a plain cell, and this says what is missing.
            self.note(f"%%cudamem_plan cannot measure here ({reason}): no plan; the cell runs as a plain cell")
            plain = run_cell_body(self.shell, cell)
            plain.show_values(self.shell)
            plain.fail(self.shell)
            return None

        shell: Any = self.shell
        history = input_history(shell)
        finding = find_batch(cell, shell.user_ns, shell.transform_cell, history=history,
                             cell_number=current_cell_number(shell))
        knob = finding.chosen
        batch = knob.value if knob is not None else None
        notes: list[str] = []
        if args.small is not None:
            if knob is None:
                raise CudaMemError(f"--small: {finding.summary()}")
            if args.small < 1 or args.small == batch:
                raise CudaMemError(f"--small takes a batch size of at least 1 other than {batch}, got {args.small}")
        if knob is None:
            notes.append(f"{finding.summary()}: measured once and planned as fixed-size")
        traits = cell_traits(cell, shell.transform_cell)
        autocast_source = dtype = None
        if args.autocast:
            if knob is None:
                notes.append("--autocast needs a batch to compare per-sample memory: not run")
            elif traits.autocast:
                notes.append("the cell already runs under autocast: --autocast adds nothing")
            else:
                from ..oomfix.strategies import default_autocast_dtype

                dtype = default_autocast_dtype()
                try:
                    autocast_source = wrap_in_autocast(cell, dtype, import_torch="torch" not in shell.user_ns,
                                                       transform=shell.transform_cell)
                except SyntaxError as error:
                    raise CudaMemError(f"--autocast: the cell does not parse ({error.msg}); nothing ran") from None
                except AutocastNotApplicable as reason:
                    notes.append(f"--autocast not run: {reason}")

        change = BatchChange(finding, knob, shell.user_ns, history) if knob is not None else None
        meter = Meter(self.hardware, reset_peak=True)
        body = BodyRuns(shell)
        # Tensors only: a plan must leave the cell's objects as they were, and a module moved in place would
        # be seen on the host by whatever else refers to it; a module the cell binds again stays bound (it is
        # the cell's fixed part).
        tensors_only = TorchMover(tensors_only=True)
        runner = Runner(meter, run=body.run, is_oom=is_cuda_oom,
                        release=self.hardware.allocator.empty_cache, quiet=capture_output,
                        set_aside=lambda source: set_aside(shell.user_ns, source, tensors_only, shell.transform_cell))
        calibrate_at = None
        if args.calibrate:
            if knob is None:
                notes.append("--calibrate needs a batch to search: not calibrated")
            else:
                calibrate_at = lambda: self._calibration_scale(runner.measured, cards)  # noqa: E731
        try:
            measured = measure_runs(runner, cell, batch, change, args.small, autocast_source, calibrate_at)
        except BaseException as error:
            failed = body.failure(error)
            if failed is None:
                raise  # ours (one line) or an interrupt outside the body
            del error
            failed.fail(shell)  # the cell's own error, shown as a plain cell shows it: no plan
            return None
        gc.collect()

        history_peak = None
        cudamem = self._cudamem()
        if cudamem is not None and batch is not None:
            history_peak = next(history_match(cudamem.history.records, source_key(cell), batch), None)
        judged = judge(measured, batch, history_peak)
        how = measured.non_pytorch_how
        if not how:
            why = self.hardware.nvml.status() or "NVML could not be read"
            how = f"NOT measured ({why}): counted as 0, so every card's usable memory is overstated by it"
        this_card = self._this_card(measured)
        calibration = measured.calibration if judged.line is not None else None
        if calibration is not None and args.margin is None:
            margin = self.calibrated_margin
        plan = build_plan(
            measured.runs, batch, knob.label if knob is not None else None, cards, margin,
            measured.non_pytorch_bytes, how, this_card, judged.line, judged.autocast_line, dtype,
            judged.agreements, notes + measured.notes + list(judged.notes), traits.trains,
            finding.summary() if knob is not None else "", judged.reserved_line, calibration,
        )
        self.last_plan = plan
        if measured.has_value and measured.value is not NO_VALUE:
            shell.displayhook(measured.value)  # the cell's value first, as %%cudamem shows it
        display(plan)
        return plan if args.output else None

    def _this_card(self, measured: Any) -> tuple[str, int] | None:
        """The card the runs used, as a plan's card: under a per-process cap, what the cap leaves."""
        if measured.total_bytes is None:
            return None
        name, total = measured.device_name or "this card", measured.total_bytes
        fraction = None
        if measured.torch_index is not None:
            try:
                fraction = self.hardware.allocator.memory_fraction(measured.torch_index)
            except Exception:  # noqa: BLE001 - an unreadable cap is no cap we can plan with
                fraction = None
        if fraction is not None and fraction < 1:
            # PyTorch may reserve ``fraction x total``; the memory outside PyTorch comes on top of it.
            capped = int(fraction * total) + measured.non_pytorch_bytes
            if capped < total:
                return f"{name}, PyTorch capped at {fraction * total / GiB:.1f} GiB", capped
        return name, total

    def _calibration_scale(self, measured: Any, cards: Any) -> Any:
        """Where --calibrate searches (``runs.CalibrationScale``): the smallest card of the plan smaller than
        this one, played by capping PyTorch here, or this card itself."""
        from ..capacity.plan import usable_bytes
        from ..capacity.runs import CalibrationScale

        here = self._this_card(measured)
        if here is None or measured.torch_index is None or not measured.total_bytes:
            return None
        usable_here = usable_bytes(here[1], measured.non_pytorch_bytes)
        smaller = sorted((usable_bytes(card.total_bytes, measured.non_pytorch_bytes), card.name) for card in cards)
        smaller = [(usable, name) for usable, name in smaller if 0 < usable < usable_here]
        allocator, index, total = self.hardware.allocator, measured.torch_index, measured.total_bytes
        try:
            before = allocator.memory_fraction(index)
        except Exception:  # noqa: BLE001 - a cap we cannot read is one we must not overwrite
            before = None
        if not smaller or before is None:
            return CalibrationScale(usable_here, here[0])
        usable, name = smaller[0]

        @contextlib.contextmanager
        def capped() -> Iterator[None]:
            allocator.set_memory_fraction(index, min(usable / total, before))
            try:
                yield
            finally:
                allocator.set_memory_fraction(index, before)

        return CalibrationScale(usable, name, capped)

    def _cudamem(self) -> Any:
        from .cudamem import CudaMem

        return None if self.extension is None else self.extension.get(CudaMem)

    def _cards_setting(self) -> dict[str, Any]:
        cudamem = self._cudamem()
        return dict(cudamem.cards) if cudamem is not None else {}
