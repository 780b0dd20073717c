"""``%oomfix``'s feature: one failed cell (a ``FixRequest``) diagnosed, freed, and rerun in a form that fits.

The magic hands over the shell, the hardware and how a try runs (``Reruns``); this owns the rest, in
order: the diagnosis, the one read of the cell, the plan (``--dry-run``) or the cleanup, the copy of what
the cell trains (``Restorer``), the ``Driver`` of the tries and what the outcome says of what was put back.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Protocol

from ..attribution.holders import find_holders, reaches_cuda
from ..attribution.probe import TensorProbe
from ..cell.read import read_cell
from ..errors import CudaMemError
from ..hardware import Hardware
from ..ipython_state import FailureRecorder, input_history, ipython_references, user_variables
from ..oom import OomInfo
from ..reruns.model_state import Restorer, TrainingState, what_to_restore
from . import cleanup as cleanup_module
from .diagnosis import Diagnosis, diagnose
from .options import check_deletable
from .driver import Driver
from .outcome import Outcome
from .plan import dry_run
from .request import FixRequest

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

    from ..breakdown import Category


class Reruns(Protocol):
    """How a try runs (``magics.oomfix_reruns.ShellReruns``: through the shell)."""

    def run_source(self, source: str) -> BaseException | None: ...

    def oom_of(self, error: BaseException) -> OomInfo | None: ...

    def forget(self) -> None: ...


# Asked before rerunning (``what_to_restore``'s answer beside the diagnosis); ``True``: rerun.
Confirm = Callable[[Diagnosis, TrainingState, bool, "str | None"], bool]


def fix(request: FixRequest, error: BaseException | None, *, shell: InteractiveShell, hardware: Hardware,
        reruns: Reruns, recorder: FailureRecorder, probe: TensorProbe | None = None,
        confirm: Confirm | None = None) -> Outcome | None:
    """Diagnose, free and rerun ``request``'s cell; ``None`` when the rerun was declined. ``error``: the
    failure, released by the cleanup (``None``: none); ``confirm`` is asked where ``request.ask``."""
    namespace = shell.user_ns
    check_deletable(request.delete)
    missing = [name for name in request.delete if name not in namespace]
    if missing:
        raise CudaMemError(f"--del {missing[0]}: no such variable; nothing was deleted")
    cell = read_cell(request.source, shell.transform_cell)  # the one read of the cell: every part gets this
    diagnosis = _diagnosis(request, shell, hardware, probe, cell.rebinds)
    if request.dry_run:
        return dry_run(request, cell, diagnosis, namespace, input_history(shell), hardware)
    trained, restore, too_large = what_to_restore(cell, namespace, request.no_restore, can_ask=request.ask)
    if request.ask and (confirm is None or not confirm(diagnosis, trained, restore, too_large)):
        return None
    holds_cuda = None if probe is None else (lambda obj: reaches_cuda(obj, probe))
    cleaned = cleanup_module.cleanup(shell, hardware, exception=error, delete_names=request.delete,
                                     holds_cuda=holds_cuda)
    error = None  # released by the cleanup: keep no reference to its frames
    restorer = Restorer(trained, namespace, copy_training=restore) if restore or not trained.plain.empty else None
    if restorer is not None:
        restorer.take()  # once, before the first rerun
    # Each try runs through ``reruns`` after ``restorer`` puts back what the cell trains; each failed one is
    # cleaned up as the failure was.
    driver = Driver(
        run_source=reruns.run_source if restorer is None else restorer.run(reruns.run_source),
        before_rerun=None if restorer is None else restorer.restore,
        held_for_step=None if restorer is None else restorer.held_for_step,
        hardware=hardware,
        cleanup=lambda failed: cleanup_module.cleanup(shell, hardware, exception=failed, holds_cuda=holds_cuda),
        max_tries=request.max_tries, strategies=request.strategies, margin=request.margin, oom_of=reruns.oom_of,
        probe=probe,
    )
    last_fitted = False  # an interrupted fix puts the state back as before the reruns
    try:
        # Our reruns are not the user's failures: the record stays the cell they ran.
        with recorder.paused():
            outcome = driver.fix(cell, None, namespace, freed_bytes=cleaned.freed_bytes, oom=request.oom,
                                 allocated_before=request.allocated_before, history=input_history(shell),
                                 cell_number=request.cell_number, cleaned=cleaned)
        # The kernel keeps the last try's state only where that try ran the cell the outcome reports.
        last = outcome.tries[-1] if outcome.tries else None
        last_fitted = last is not None and last.fitted and last.source == outcome.fixed_source
    finally:
        reruns.forget()
        if restorer is not None:
            restorer.finish(last_fitted)
    notes = request.limit_notes + outcome.notes + restore_notes(trained, restorer, outcome, last_fitted)
    outcome = dataclasses.replace(outcome,
                                  cleanup_note=diagnosis.cleanup_explanation(cleaned.freed_bytes, cleaned.deleted),
                                  notes=notes, diagnosis=diagnosis, verbose=request.verbose,
                                  cell_name=request.cell_name, kept=last_fitted,
                                  applied=request.apply and outcome.changed)
    if outcome.fitted:
        recorder.forget()
    return outcome


def restore_notes(trained: TrainingState, restorer: Restorer | None, outcome: Outcome,
                  last_fitted: bool) -> tuple[str, ...]:
    """What the outcome says became of the training state and the plain values put back around the reruns
    (whether they are copied, and the copying, are ``reruns.model_state``'s)."""
    if not outcome.tries:
        return ()
    notes: list[str] = []
    put_back = (" put back before each rerun: as one run of the cell that fitted leaves them" if last_fitted
                else " put back as they were before the reruns")
    if not trained.empty:
        if restorer is None or not restorer.copy_training:
            notes.append(f"the reruns' training steps stayed in {trained.describe()}: their state was not put back")
        else:
            notes.append(trained.describe() + put_back)
    if restorer is None:
        return tuple(notes)
    plain = trained.plain
    if plain.changed:
        notes.append(", ".join(plain.changed) + put_back)
    if restorer.unrestored:
        notes.append(f"could not be put back, so the reruns' changes stay: {'; '.join(restorer.unrestored)}")
    if plain.too_large:
        notes.append(f"too large to copy, so not put back where the reruns changed them: {', '.join(plain.too_large)}")
    return tuple(notes)


def _diagnosis(request: FixRequest, shell: InteractiveShell, hardware: Hardware, probe: TensorProbe | None,
               made_by_cell: Collection[str]) -> Diagnosis:
    """Who holds memory now, and what the failure's figures say of it. What the failed cell binds before
    reading it (``made_by_cell``: its batch, its outputs) is the cell's own memory, made again by any
    rerun: not the variables a user could delete, yet held by a name, so not the traceback's alone."""
    holders = find_holders(user_variables(shell), ipython_references(shell), probe=probe, remade=made_by_cell)
    readings = hardware.allocator_readings() or None
    diagnosis = diagnose(request.oom, holders, readings, _model_state(shell.user_ns))
    return dataclasses.replace(diagnosis, verbose=request.verbose)


def _model_state(namespace: Mapping[str, object]) -> dict[Category, int] | None:
    """Parameters, gradients and optimizer state of the models and optimizers bound to names (bytes), for
    the diagnosis's split by category; ``None`` where torch was never imported or they cannot be read."""
    if "torch" not in sys.modules:
        return None
    try:
        from ..sources.torch_breakdown import model_state_bytes, namespace_objects

        _, models, optimizers = namespace_objects(namespace)
        return model_state_bytes(models, optimizers)
    except Exception:  # noqa: BLE001  the split is extra: the diagnosis stands without it
        return None
