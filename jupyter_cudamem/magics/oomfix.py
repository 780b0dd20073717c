"""``%oomfix`` and ``%%oomfix``: turn a CUDA out-of-memory error into a cell that fits.

Thin: finds the failed cell in IPython's records (``ipython_state``), asks before rerunning,
and hands the work to ``oomfix.diagnosis``, ``oomfix.cleanup`` and ``oomfix.driver``. Configure with
``%config OomFix.max_tries = 5`` and the like.
"""

from __future__ import annotations

import dataclasses

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from IPython.core.magic import cell_magic, line_magic, magics_class, no_var_expand
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from traitlets import Bool, Float, Int, TraitError, Unicode, validate

from ..errors import CudaMemError
from ..oomfix.driver import Driver
from ..oom import OomInfo, parse_oom
from ..oomfix.outcome import Outcome
from ..oomfix.options import check_max_tries, check_strategies
from ..oomfix.strategies import STRATEGIES
from .base import CudaMemMagicsBase, one_line_errors
from .cellrun import run_cell_body

_ABSENT = object()

_SIDE_EFFECTS = (
    "%oomfix reruns the cell (up to {tries} times): anything it does besides computing (writing files, "
    "printing, appending to lists) happens again."
)
_RESTORED = " The model and optimizer state it trains ({names}) is put back before each rerun."
_NOT_RESTORED = " The reruns' training steps stay in {names} (--no-restore)."


def _cap_note(cap: int | None) -> tuple[str, ...]:
    from ..units import format_bytes

    if cap is None:
        return ()
    return (f"planned under the cell's --limit {format_bytes(cap)}: its reruns run under it too",)


def _state_note(trained: Any, restore: bool, too_large: str | None) -> str:
    """What the question before rerunning says of the training state."""
    if trained.empty:
        return ""
    if restore:
        return _RESTORED.format(names=trained.describe())
    if too_large is not None:
        return f" Note: {too_large}."
    return _NOT_RESTORED.format(names=trained.describe())


def _options(function: Callable[..., Any]) -> Callable[..., Any]:
    """The options both forms share."""
    for decorator in reversed((
        argument("--dry-run", action="store_true", help="Diagnose only: free nothing, rerun nothing."),
        argument("--max-tries", type=int, default=None, metavar="N",
                 help="At most N reruns (default: OomFix.max_tries, 3)."),
        argument("--del", dest="delete", action="append", default=[], metavar="NAME",
                 help="Also delete this variable before rerunning (repeatable). Nothing of yours is deleted otherwise."),
        argument("--apply", action="store_true",
                 help="Put the cell that fitted into the next input (shown, never run silently)."),
        argument("--yes", "-y", action="store_true",
                 help="Do not ask before rerunning; the rerun repeats the cell's side effects."),
        argument("--no-autocast", action="store_true", help="Never try torch.autocast."),
        argument("--no-restore", action="store_true",
                 help="Do not copy the model and optimizer state the cell trains to put it back before each "
                      "rerun (needed where that copy would not fit in host memory); each rerun's steps then stay."),
        argument("--strategy", default=None, metavar="LIST",
                 help=f"Strategies to try, in order, comma-separated: {', '.join(STRATEGIES)} (default: all)."),
        argument("-o", "--output", action="store_true",
                 help="Show the outcome and also return it, as %%timeit -o does: outcome = %%oomfix -o "
                      "(.tries, .diff, .fixed_source); None where no fix was tried (the rerun declined, or a %%%%oomfix "
                      "cell that did not run out of memory)."),
    )):
        function = decorator(function)
    return function


@magics_class
class OomFix(CudaMemMagicsBase):
    """Fix a cell that ran out of GPU memory: diagnose, free, and rerun it in a form that fits.

    Configure with ``%config OomFix.<option> = ...``.
    """

    max_tries = Int(3, help="Most reruns %oomfix makes for one failure.").tag(config=True)
    strategies = Unicode(",".join(STRATEGIES), help="Strategies in order: cleanup, batch, autocast.").tag(config=True)
    autocast = Bool(True, help="Whether autocast is among the strategies.").tag(config=True)
    confirm = Bool(True, help="Ask before rerunning a cell (its side effects repeat); --yes skips it.").tag(config=True)
    margin = Float(0.04, help="Fraction of the free memory a predicted batch leaves unused.").tag(config=True)

    # Checked when set (``%config`` prints the one line); every option is read at the next %oomfix.
    @validate("max_tries")
    def _check_max_tries(self, proposal: Any) -> int:
        try:
            return check_max_tries(proposal["value"])
        except CudaMemError as error:
            raise TraitError(f"OomFix.{error}") from None

    @validate("strategies")
    def _check_strategies(self, proposal: Any) -> str:
        try:
            check_strategies(proposal["value"])
        except CudaMemError as error:
            raise TraitError(f"OomFix.strategies: {error}") from None
        return proposal["value"]

    @validate("margin")
    def _check_margin(self, proposal: Any) -> float:
        value = proposal["value"]
        if not 0.0 <= value < 1.0:
            raise TraitError(
                f"OomFix.margin takes the fraction of free memory a predicted batch leaves unused, "
                f"from 0 up to (not including) 1, such as 0.04; got {value!r}"
            )
        return value

    def __init__(self, shell: Any, hardware: Any, extension: Any = None, **kwargs: Any):
        super().__init__(shell=shell, hardware=hardware, extension=extension, **kwargs)
        from ..ipython_state import FailureRecorder, recorder_for

        existing = recorder_for(shell)
        self._recorder = existing if existing is not None else FailureRecorder()
        self._owns_recorder = existing is None
        if self._owns_recorder:
            self._recorder.attach(shell)
        self.last_outcome: Outcome | None = None
        # PyTorch's allocated bytes per device when each recent cell started, with the cell's source
        # (execution counts are numbered differently across IPython versions): with an OOM's figures
        # they bound what the failed cell itself needed. One allocator read per cell.
        self._allocated_at_start: list[tuple[str, dict[int, int]]] = []
        shell.events.register("pre_run_cell", self._note_cell_start)
        # How tensors are recognised (``attribution.TensorProbe``); ``None`` means PyTorch's types.
        self.probe: Any = None
        # The last rerun's exception (by id: no reference to its frames) and its OOM, parsed once by the
        # hook that hides its traceback, for the driver to read (``_oom_of``).
        self._try_oom: tuple[int, OomInfo | None] | None = None

    def close(self) -> None:
        if self._owns_recorder:
            self._recorder.detach(self.shell)
        try:
            self.shell.events.unregister("pre_run_cell", self._note_cell_start)
        except ValueError:
            pass

    def _note_cell_start(self, info: Any = None) -> None:
        # A callback must never raise into the kernel: a reading we cannot take is simply missing.
        try:
            readings = self._allocated_now()
            if readings is None:
                return
            raw_cell = getattr(info, "raw_cell", None)
            if isinstance(raw_cell, str):
                self._allocated_at_start = self._allocated_at_start[-7:] + [(raw_cell, readings)]
        except Exception:
            return

    def _allocated_now(self) -> dict[int, int] | None:
        readings = self._readings()
        return None if readings is None else {index: r.allocated_bytes for index, r in readings.items()}

    # -- the line magic ------------------------------------------------------------------------
    @magic_arguments()
    @_options
    @line_magic
    @one_line_errors
    def oomfix(self, line: str = "") -> Outcome | None:
        """Fix the last cell that failed with a CUDA out-of-memory error.

        Diagnoses the failure (what the message says, what holds memory), frees what the failure
        left behind, then reruns the cell: unchanged, with a smaller batch found by measuring, or
        under autocast. Prints every try, the cell that fitted as a diff, and advice.
        """
        args = parse_argstring(self.oomfix, line)
        from ..ipython_state import last_failure

        if not args.dry_run:
            self._require_gpu()
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
        started = next((r for cell, r in reversed(self._allocated_at_start) if cell == failure.raw_cell), None)
        return self._fix(args, failure.raw_cell, failure.exception, oom, started, failure.execution_count)

    # -- the cell magic ------------------------------------------------------------------------
    @magic_arguments()
    @_options
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
        args = parse_argstring(self.oomfix_cell, line)
        self._check_options(args)  # before running the body: a typo in the options must not cost a run
        shell = self.shell
        reason = self.hardware.allocator.status()
        if reason is not None and not args.dry_run:
            self.note(f"%%oomfix cannot fix out-of-memory here ({reason}); the cell runs as a plain cell")
            plain = run_cell_body(shell, cell)
            plain.show_values(shell)
            plain.fail(shell)
            return None
        started = self._allocated_now()
        ran = run_cell_body(shell, cell)
        ran.show_values(shell)
        error = ran.error
        oom = None if error is None else parse_oom(error)  # parsed once: None is no OOM
        if oom is None:
            ran.fail(shell)  # no error: nothing; another error: as a plain cell
            return None
        if args.dry_run:
            ran.fail(shell)  # --dry-run fixes nothing: the cell fails, then the plan is shown
            return self._fix(args, cell, None, oom, started, getattr(shell, "execution_count", None))
        print(f"%%oomfix: the cell ran out of GPU memory ({type(error).__name__}); fixing it")
        self.last_outcome = None
        failure: BaseException | None = None
        try:
            shown = self._fix(args, cell, error, oom, started, getattr(shell, "execution_count", None))
        except BaseException as raised:  # ours (one line) or their Ctrl-C: after the user's own error
            failure = raised
        del error
        if failure is not None:
            ran.fail(shell)
            raise failure
        outcome = self.last_outcome
        if outcome is None or not outcome.fitted:
            # Declined: the traceback is intact. Tried and failed: the cleanup cleared its frames to free
            # their memory, so the error is shown without them.
            ran.fail(shell, frames=outcome is None)
        return shown

    # -- shared ----------------------------------------------------------------------------------
    def _require_gpu(self) -> None:
        reason = self.hardware.allocator.status()
        if reason is not None:
            raise CudaMemError(f"%oomfix needs a CUDA device: {reason}")

    def _check_options(self, args: Any) -> None:
        """The options' values, checked before anything runs; each error is one line."""
        if args.max_tries is not None:
            check_max_tries(args.max_tries)
        self._strategies(args)

    def _strategies(self, args: Any) -> tuple[str, ...]:
        chosen = check_strategies(args.strategy if args.strategy is not None else self.strategies)
        if args.no_autocast or not self.autocast:
            chosen = tuple(s for s in chosen if s != "autocast")
        if not chosen:
            raise CudaMemError("no strategy left to try: --strategy autocast with --no-autocast leaves nothing")
        return chosen

    def _model_state(self) -> Any:
        """Parameters, gradients and optimizer state of the models and optimizers bound to names (bytes), for
        the diagnosis's split by category; ``None`` where torch was never imported or they cannot be read."""
        import sys

        if "torch" not in sys.modules:
            return None
        try:
            from ..sources.torch_breakdown import model_state_bytes, namespace_objects

            _, models, optimizers = namespace_objects(self.shell.user_ns)
            return model_state_bytes(models, optimizers)
        except Exception:  # noqa: BLE001  the split is extra: the diagnosis stands without it
            return None

    def _fix(
        self,
        args: Any,
        source: str,
        error: BaseException | None,
        oom: OomInfo | None,
        allocated_at_start: dict[int, int] | None = None,
        cell_number: int | None = None,
    ) -> Outcome | None:
        device = oom.device_index if oom is not None and oom.device_index is not None else 0
        with self._cell_cap(source, device) as cap:
            outcome = self._fix_capped(args, source, error, oom, allocated_at_start, cell_number, cap)
        return outcome

    @contextmanager
    def _cell_cap(self, source: str, device: int) -> Iterator[int | None]:
        """A failed ``%%cudamem --limit`` cell ran under its cap, and its reruns do again: the fix plans
        under it (the allocator capped as the cell capped it while the fix runs; put back after)."""
        from .cudamem import CudaMem

        extension = self.extension
        measuring = extension.get(CudaMem) if extension is not None else None
        cap = measuring.limit_of(source) if isinstance(measuring, CudaMem) else None
        allocator = self.hardware.allocator
        if cap is None or allocator.status() is not None:
            yield None
            return
        previous = allocator.memory_fraction(device)
        before = 1.0 if previous is None else previous
        allocator.set_memory_fraction(device, min(cap / allocator.device(device).total_bytes, before))
        try:
            yield cap
        finally:
            allocator.set_memory_fraction(device, before)

    def _fix_capped(
        self,
        args: Any,
        source: str,
        error: BaseException | None,
        oom: OomInfo | None,
        allocated_at_start: dict[int, int] | None,
        cell_number: int | None,
        cap: int | None,
    ) -> Outcome | None:
        from ..oomfix import cleanup as cleanup_module
        from ..oomfix.diagnosis import diagnose
        from ..attribution.holders import find_holders, reaches_cuda
        from ..ipython_state import input_history, ipython_references, user_variables

        if not args.dry_run:
            self._require_gpu()
        max_tries = check_max_tries(self.max_tries if args.max_tries is None else args.max_tries)
        strategies = self._strategies(args)
        missing = [name for name in args.delete if name not in self.shell.user_ns]
        if missing:
            raise CudaMemError(f"--del {missing[0]}: no such variable; nothing was deleted")
        holders = find_holders(user_variables(self.shell), ipython_references(self.shell), probe=self.probe)
        if oom is None:  # an OOM whose message says nothing we parse: diagnose from the holders alone
            oom = OomInfo("other", "" if error is None else str(error))
        diagnosis = diagnose(oom, holders, self._readings(), self._model_state())
        if args.dry_run:
            preview = self._preview(source, oom, diagnosis, strategies, max_tries, cell_number)
            return self._show(dataclasses.replace(preview, notes=preview.notes + _cap_note(cap)), args)
        self._display(diagnosis)
        trained, restore, too_large = self._training_state(source, args)
        if not args.yes and self.confirm and not self._confirmed(max_tries, _state_note(trained, restore, too_large)):
            return None

        holds_cuda = None if self.probe is None else (lambda obj: reaches_cuda(obj, self.probe))
        cleaned = cleanup_module.cleanup(
            self.shell, self.hardware, exception=error, delete_names=tuple(args.delete), holds_cuda=holds_cuda
        )
        error = None  # released by the cleanup: keep no reference to its frames
        from ..reruns.model_state import Restorer

        restorer = Restorer(trained) if restore else None
        if restorer is not None:
            restorer.take()  # once, before the first rerun
        driver = Driver(
            run_source=self._run_source if restorer is None else restorer.run(self._run_source),
            before_rerun=None if restorer is None else restorer.restore,
            hardware=self.hardware,
            cleanup=lambda failed: cleanup_module.cleanup(self.shell, self.hardware, exception=failed, holds_cuda=holds_cuda),
            max_tries=max_tries,
            strategies=strategies,
            transform=self.shell.transform_cell,
            margin=self.margin,
            oom_of=self._oom_of,
            probe=self.probe,
        )
        device = oom.device_index if oom is not None and oom.device_index is not None else 0
        before = None if allocated_at_start is None else allocated_at_start.get(device)
        last_fitted = False  # an interrupted fix puts the state back as before the reruns
        try:
            # Our reruns are not the user's failures: the record stays the cell they ran.
            with self._recorder.paused():
                outcome = driver.fix(source, None, self.shell.user_ns, freed_bytes=cleaned.freed_bytes, oom=oom,
                                     allocated_before=before, history=input_history(self.shell),
                                     cell_number=cell_number, cleaned=cleaned)
            last_fitted = bool(outcome.tries) and outcome.tries[-1].fitted
        finally:
            self._try_oom = None
            if restorer is not None:
                restorer.finish(last_fitted)
        notes = _cap_note(cap) + outcome.notes + self._restore_notes(trained, restorer, outcome, last_fitted)
        outcome = dataclasses.replace(outcome, cleanup_note=diagnosis.cleanup_explanation(cleaned.freed_bytes),
                                      notes=notes)
        if outcome.fitted:
            self._recorder.forget()
        return self._show(outcome, args)

    def _preview(
        self, source: str, oom: OomInfo | None, diagnosis: Any, strategies: tuple[str, ...], max_tries: int,
        cell_number: int | None,
    ) -> Outcome:
        """``--dry-run``: the diagnosis and the plan (which knob, where it lives, the first try); no GPU needed."""
        from ..batch import find_batch
        from ..hardware import headroom_bytes
        from ..ipython_state import input_history
        from ..oomfix.plan import budget_from_message, plan_batch, preview

        shell: Any = self.shell
        history = input_history(shell)
        if cell_number is None:  # the failure was found without its count: the last time this source ran
            cell_number = next((k for k in range(len(history) - 1, 0, -1) if history[k] == source), None)
        finding = find_batch(source, shell.user_ns, shell.transform_cell, history=history, cell_number=cell_number)
        device = oom.device_index if oom is not None and oom.device_index is not None else 0
        measured = headroom_bytes(self.hardware, device) if self.hardware.allocator.status() is None else None
        budget = measured if measured is not None else budget_from_message(oom)
        plan = plan_batch(finding, shell.user_ns, history, budget, strategies,  # type: ignore[arg-type]
                          max_tries=max_tries, margin=self.margin,
                          budget_source="the measured" if measured is not None else "the error message's")
        return preview(source, finding, plan, diagnosis, measured)

    def _readings(self) -> dict[int, Any] | None:
        """The allocator's readings now, per device, for the diagnosis (``None`` where unreadable)."""
        return self.hardware.allocator_readings() or None

    def _training_state(self, source: str, args: Any) -> tuple[Any, bool, str | None]:
        """The model and optimizer state the cell trains (``reruns.model_state``), whether its host copy
        is to be taken, and why not when it would not fit in host memory; one line asking for
        --no-restore when it would not fit and nobody can be asked."""
        from ..cell.source import parse_cell
        from ..reruns.set_aside import names_bound_before_read
        from ..reruns.model_state import TrainingState, copy_fits, training_state
        from ..sources.host import available_bytes
        from ..units import format_bytes

        try:
            tree = parse_cell(source, self.shell.transform_cell).tree
        except (SyntaxError, ValueError):
            return TrainingState(), False, None  # a cell that does not parse reruns to fail as it did
        trained = training_state(self.shell.user_ns, tree, names_bound_before_read(tree))
        if args.no_restore or trained.empty:
            return trained, False, None
        available = available_bytes()
        if copy_fits(trained.nbytes, available):
            return trained, True, None
        too_large = (
            f"the model and optimizer state the cell trains ({trained.describe()}) takes "
            f"{format_bytes(trained.nbytes)}, more than the host can copy ({format_bytes(available)} available), "
            "so it cannot be put back before each rerun: every rerun's training steps would stay"
        )
        if args.yes or not self.confirm:
            raise CudaMemError(f"{too_large}; add --no-restore to rerun anyway")
        return trained, False, too_large

    @staticmethod
    def _restore_notes(trained: Any, restorer: Any, outcome: Outcome, last_fitted: bool) -> tuple[str, ...]:
        if trained.empty or len(outcome.tries) == 0:
            return ()
        names = trained.describe()
        if restorer is None:
            return (f"the reruns' training steps stayed in {names}: their state was not put back",)
        if last_fitted:
            return (f"{names} put back before each rerun: as one run of the cell that fitted leaves them",)
        return (f"{names} put back as they were before the reruns",)

    def _confirmed(self, max_tries: int, state_note: str = "") -> bool:
        from IPython.core.error import StdinNotImplementedError

        print(_SIDE_EFFECTS.format(tries=max_tries) + state_note)
        try:
            answer = input("Rerun it? [y/N] ")
        except (StdinNotImplementedError, EOFError, OSError):
            raise CudaMemError(
                "cannot ask before rerunning (no input here, as under nbclient or a script): "
                "add --yes to accept that the rerun repeats the cell's side effects"
            ) from None
        if answer.strip().lower() in ("y", "yes"):
            return True
        print("Nothing rerun; memory not freed. %oomfix --dry-run shows the diagnosis only.")
        return False

    @contextmanager
    def _quiet_oom_tracebacks(self) -> Iterator[None]:
        """While rerunning, an OOM is an expected outcome of a try: record it, do not print its traceback."""
        shell = self.shell
        before = vars(shell).get("showtraceback", _ABSENT)  # an instance attribute someone set, or none
        original = shell.showtraceback

        def showtraceback(*args: Any, **kwargs: Any) -> Any:
            # A magic that shows its body's error itself (a rerun of a %%cudamem cell) hands it over as
            # ``exc_tuple``; IPython's own callers leave it in sys.exc_info().
            given = args[0] if args else kwargs.get("exc_tuple")
            error = given[1] if isinstance(given, tuple) and len(given) == 3 else sys.exc_info()[1]
            oom = None if error is None else parse_oom(error)
            if error is not None:
                self._try_oom = (id(error), oom)  # the driver reads it next (``_oom_of``)
            if oom is not None:
                return None
            return original(*args, **kwargs)

        vars(shell)["showtraceback"] = showtraceback
        try:
            yield
        finally:
            if before is _ABSENT:
                vars(shell).pop("showtraceback", None)  # the class's method shows again
            else:
                vars(shell)["showtraceback"] = before  # what was there before us

    def _oom_of(self, error: BaseException) -> OomInfo | None:
        """A rerun's OOM as ``showtraceback`` parsed it (the driver still holds ``error``, so its id is
        its own), else parsed now; read once."""
        seen, self._try_oom = self._try_oom, None
        return seen[1] if seen is not None and seen[0] == id(error) else parse_oom(error)

    def _run_source(self, source: str) -> BaseException | None:
        """Run IPython input through the shell (so ``!cmd`` and magics work); return its exception."""
        with self._quiet_oom_tracebacks():
            result = self.shell.run_cell(source, store_history=False)
        return result.error_in_exec if result.error_in_exec is not None else result.error_before_exec

    def _display(self, obj: Any) -> None:
        from IPython.display import display

        display(obj)

    def _show(self, outcome: Outcome, args: Any) -> Outcome | None:
        self.last_outcome = outcome
        self._display(outcome)
        if outcome.changed:
            if args.apply:
                self.shell.set_next_input(outcome.paste, replace=False)
                print("%oomfix: the cell that fitted is in the next input; run it to keep it")
            elif not outcome.dry_run:
                print("%oomfix: add --apply to get the cell that fitted as the next input")
        return outcome if args.output else None
