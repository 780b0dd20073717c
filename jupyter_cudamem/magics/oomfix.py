"""``%oomfix`` and ``%%oomfix``: turn a CUDA out-of-memory error into a cell that fits.

Thin: finds the failed cell in IPython's records (``ipython_state``), reads it with its options
(``oomfix_arguments``), ``OomFix``'s settings and the ``--limit`` it ran under (``CudaMem.limit_of``) into one
``oomfix.request.FixRequest``, and calls the feature, ``oomfix.fix.fix``, with the shell, the hardware,
the tries through the shell (``oomfix_reruns``) and the question before rerunning (``oomfix_dialogue``).
What each cell started with is kept by ``cell_starts``. Configure with ``%config OomFix.max_tries = 5``
and the like.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from IPython.core.magic import cell_magic, line_magic, magics_class, no_var_expand
from IPython.core.magic_arguments import magic_arguments
from IPython.display import display
from traitlets import Bool, Int, TraitError, Unicode, validate

from ..errors import CudaMemError
from ..growth.fitting import REPLAY_MARGIN
from ..oom import OomInfo, oom_device, parse_oom
from ..oomfix.diagnosis import Diagnosis
from ..oomfix.fix import Confirm, fix
from ..oomfix.options import check_max_tries, check_strategies
from ..oomfix.outcome import Outcome
from ..oomfix.request import FixRequest
from ..oomfix.strategies import STRATEGIES
from ..reruns.model_state import TrainingState
from ..units import format_bytes
from .base import CudaMemMagicsBase, current_cell_number, one_line_errors
from .cellrun import error_is_raised, run_cell_body
from .oomfix_arguments import check_options, chosen_strategies, oomfix_options, require_gpu
from .oomfix_dialogue import confirmed, show, state_note
from .oomfix_reruns import ShellReruns
from .options import Float, parse_line

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.utils.bunch import Bunch

    from ..attribution.probe import TensorProbe
    from ..hardware import Hardware
    from . import Extension


@magics_class
class OomFix(CudaMemMagicsBase):
    """Fix a cell that ran out of GPU memory: diagnose, free, and rerun it in a form that fits.

    Configure with ``%config OomFix.<option> = ...``.
    """

    max_tries = Int(3, help="Most reruns %oomfix makes for one failure.").tag(config=True)
    strategies = Unicode(",".join(STRATEGIES), help="Strategies in order: cleanup, batch, autocast.").tag(config=True)
    autocast = Bool(True, help="Whether autocast is among the strategies.").tag(config=True)
    confirm = Bool(True, help="Ask before rerunning a cell (its side effects repeat); --yes skips it.").tag(config=True)
    margin = Float(0.04, help="Share of the room above what does not grow with the batch that a batch predicted by "
                   "the line of measured peaks leaves unused (a replay's prediction takes its per-sample requests "
                   f"{REPLAY_MARGIN:.0%} larger instead).").tag(config=True)
    verbose = Bool(False, help="Show everything under the three first lines, as --verbose does.").tag(config=True)

    # Checked when set (``%config`` prints the one line); every option is read at the next %oomfix.
    @validate("max_tries")
    def _check_max_tries(self, proposal: Bunch) -> int:
        try:
            return check_max_tries(proposal["value"])
        except CudaMemError as error:
            raise TraitError(f"OomFix.{error}") from None

    @validate("strategies")
    def _check_strategies(self, proposal: Bunch) -> str:
        try:
            check_strategies(proposal["value"])
        except CudaMemError as error:
            raise TraitError(f"OomFix.strategies: {error}") from None
        return proposal["value"]

    @validate("margin")
    def _check_margin(self, proposal: Bunch) -> float:
        value = proposal["value"]
        if not 0.0 <= value < 1.0:
            raise TraitError(
                f"OomFix.margin takes the fraction of free memory a predicted batch leaves unused, "
                f"from 0 up to (not including) 1, such as 0.04; got {value!r}"
            )
        return value

    def __init__(self, shell: InteractiveShell, hardware: Hardware, extension: Extension, **kwargs: object):
        super().__init__(shell=shell, hardware=hardware, extension=extension, **kwargs)
        from ..ipython_state import FailureRecorder, recorder_for

        existing = recorder_for(shell)
        self._recorder = existing if existing is not None else FailureRecorder()
        self._owns_recorder = existing is None
        if self._owns_recorder:
            self._recorder.attach(shell)
        self.last_outcome: Outcome | None = None
        # PyTorch's allocated bytes per device when each recent cell started: with an OOM's figures they
        # bound what the failed cell itself needed.
        self.cell_starts = extension.cell_starts
        # How tensors are recognised (``attribution.TensorProbe``); ``None`` means PyTorch's types.
        self.probe: TensorProbe | None = None
        self.reruns = ShellReruns(shell)

    def close(self) -> None:
        if self._owns_recorder:
            self._recorder.detach(self.shell)

    # -- the line magic ------------------------------------------------------------------------
    @magic_arguments()
    @oomfix_options
    @line_magic
    @one_line_errors
    def oomfix(self, line: str = "") -> Outcome | None:
        """Fix the last cell that failed with a CUDA out-of-memory error.

        Diagnoses the failure (what the message says, what holds memory), frees what the failure
        left behind, then reruns the cell: unchanged, with a smaller batch found by measuring, or
        under autocast. Prints every try, the cell that fitted as a diff, and advice.
        """
        args = parse_line(self.oomfix, line)
        from ..ipython_state import last_failure

        if not args.dry_run:
            require_gpu(self.hardware)
        failure = last_failure(self.shell)
        if failure is None:
            raise CudaMemError("no failed cell to fix: run the cell first, or run it under %%oomfix")
        oom = failure.oom()
        if oom is None:
            raise CudaMemError(
                f"the last failure was {failure.exception_type}, not a GPU out-of-memory error; %oomfix did nothing"
            )
        if not failure.raw_cell:
            raise CudaMemError("the failed cell's source is not in IPython's history; rerun it under %%oomfix")
        started = self.cell_starts.of(failure.raw_cell)
        return self._fix(args, failure.raw_cell, failure.exception, oom, started, failure.execution_count)

    # -- the cell magic ------------------------------------------------------------------------
    # The usage line is "%" + this name: %%oomfix, not the method's name (%oomfix_cell).
    @magic_arguments("%oomfix")
    @oomfix_options
    @no_var_expand
    @cell_magic("oomfix")  # type: ignore[arg-type]  # IPython annotates cell_magic("name") as taking Never
    @one_line_errors
    def oomfix_cell(self, line: str, cell: str) -> Outcome | None:
        """Run this cell; if it runs out of GPU memory, fix it and rerun it as %oomfix does.

        The body runs as a plain cell. An error that is not fixed (any error but a CUDA out-of-memory
        one, an out-of-memory error under --dry-run, a fix declined or not found) fails the cell exactly
        as a plain cell fails: the same traceback, and a notebook run that stops on errors stops here.
        Without a CUDA device the body runs as a plain cell after a one-line note.
        """
        __tracebackhide__ = True  # noqa: F841
        args = parse_line(self.oomfix_cell, line)
        check_options(args, self.strategies, self.autocast)  # before running the body: a typo in the options must not cost a run
        shell = self.shell
        reason = self.hardware.allocator.status()
        if reason is not None and not args.dry_run:
            self.note(f"%%oomfix cannot fix out-of-memory here ({reason}); the cell runs as a plain cell")
            plain = run_cell_body(shell, cell)
            plain.show_values(shell)
            plain.fail(shell)
            return None
        started = self.cell_starts.allocated_now()
        ran = run_cell_body(shell, cell)
        ran.show_values(shell)
        error = ran.error
        oom = None if error is None else parse_oom(error)  # parsed once: None is no OOM
        if oom is None:
            ran.fail(shell)  # no error: nothing; another error: as a plain cell
            return None
        if args.dry_run:  # --dry-run fixes nothing: the cell fails, and the plan is shown
            raised = error_is_raised(shell)
            if not raised:
                ran.fail(shell)  # shown: the error, then the plan
            preview = self._fix(args, cell, None, oom, started, current_cell_number(shell))
            if raised:
                ran.fail(shell)  # raised, it ends the magic: the plan comes first
            return preview
        print(f"%%oomfix: the cell ran out of GPU memory ({type(error).__name__}); fixing it")
        self.last_outcome = None
        failure: BaseException | None = None
        try:
            shown = self._fix(args, cell, error, oom, started, current_cell_number(shell))
        except BaseException as raised:  # ours (one line) or their Ctrl-C: after the user's own error
            failure = raised
        del error
        if failure is not None:
            if not error_is_raised(shell):
                ran.fail(shell)  # shown first; raised, it would hide ``failure``
            raise failure
        outcome = self.last_outcome
        if outcome is None or not outcome.fitted:
            # Declined: the traceback is intact. Tried and failed: the cleanup cleared its frames to free
            # their memory, so the error is shown without them.
            ran.fail(shell, frames=outcome is None)
        return shown

    # -- shared ----------------------------------------------------------------------------------
    def _fix(
        self,
        args: argparse.Namespace,
        source: str,
        error: BaseException | None,
        oom: OomInfo,
        allocated_at_start: dict[int, int] | None = None,
        cell_number: int | None = None,
    ) -> Outcome | None:
        device = oom_device(oom)
        cap = self._cell_limit(source)
        # A failed --limit cell is planned under its cap, and its reruns run under it too (put back after).
        with self.hardware.capped(cap, [device]) as capped:
            if not args.dry_run:
                require_gpu(self.hardware)
            request = FixRequest(
                source=source,
                oom=oom,
                max_tries=check_max_tries(self.max_tries if args.max_tries is None else args.max_tries),
                strategies=chosen_strategies(args, self.strategies, self.autocast),
                margin=self.margin,
                cell_number=cell_number,
                allocated_before=None if allocated_at_start is None else allocated_at_start.get(device),
                delete=tuple(args.delete),
                dry_run=bool(args.dry_run),
                ask=not args.yes and self.confirm,
                no_restore=bool(args.no_restore),
                apply=bool(args.apply),
                verbose=bool(args.verbose or self.verbose),
                limit_notes=limit_notes(cap if capped else None),
            )
            outcome = fix(request, error, shell=self.shell, hardware=self.hardware, reruns=self.reruns,
                          recorder=self._recorder, probe=self.probe, confirm=self._confirm(request.max_tries))
        del error
        if outcome is None:
            return None
        self.last_outcome = outcome
        show(outcome, args.apply, self.shell)
        return outcome if args.output else None

    def _cell_limit(self, source: str) -> int | None:
        """The ``--limit`` (bytes) the failed cell ran under, as ``%%cudamem`` read it; ``None``: no cap."""
        from .cudamem import CudaMem

        measuring = self.extension.get(CudaMem)
        return measuring.limit_of(source) if isinstance(measuring, CudaMem) else None

    @staticmethod
    def _confirm(max_tries: int) -> Confirm:
        """The question before rerunning, after the diagnosis it is about (with --yes the outcome carries it)."""

        def ask(diagnosis: Diagnosis, trained: TrainingState, restore: bool, too_large: str | None) -> bool:
            display(diagnosis)
            return confirmed(max_tries, state_note(trained, restore, too_large))

        return ask


def limit_notes(cap: int | None) -> tuple[str, ...]:
    """What the outcome says of the cap it was planned under (``None``: none)."""
    if cap is None:
        return ()
    return (f"planned under the cell's --limit {format_bytes(cap)}: its reruns run under it too",)
