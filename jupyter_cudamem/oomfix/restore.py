"""The model and optimizer state a failed cell trains, put back around ``%oomfix``'s reruns: whether its host
copy is taken (only when it fits in host memory, and not under ``--no-restore``), and what the outcome says
became of it. The copying itself is ``reruns.model_state``'s."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..errors import CudaMemError
from .outcome import Outcome


def what_to_restore(
    source: str, namespace: Mapping[str, Any], transform: Callable[[str], str], no_restore: bool, can_ask: bool
) -> tuple[Any, bool, str | None]:
    """The state the cell trains (``reruns.model_state.TrainingState``), whether its host copy is to be
    taken, and why not when it would not fit in host memory; one line asking for --no-restore when it
    would not fit and nobody can be asked (``can_ask`` false: --yes, or ``OomFix.confirm`` off)."""
    from ..cell.source import parse_cell
    from ..reruns.set_aside import names_bound_before_read
    from ..reruns.model_state import TrainingState, copy_fits, training_state
    from ..sources.host import available_bytes
    from ..units import format_bytes

    try:
        tree = parse_cell(source, transform).tree
    except (SyntaxError, ValueError):
        return TrainingState(), False, None  # a cell that does not parse reruns to fail as it did
    trained = training_state(namespace, tree, names_bound_before_read(tree))
    if no_restore or trained.empty:
        return trained, False, None
    available = available_bytes()
    if copy_fits(trained.nbytes, available):
        return trained, True, None
    too_large = (
        f"the model and optimizer state the cell trains ({trained.describe()}) takes "
        f"{format_bytes(trained.nbytes)}, more than the host can copy ({format_bytes(available)} available), "
        "so it cannot be put back before each rerun: every rerun's training steps would stay"
    )
    if not can_ask:
        raise CudaMemError(f"{too_large}; add --no-restore to rerun anyway")
    return trained, False, too_large


def restore_notes(trained: Any, restorer: Any, outcome: Outcome, last_fitted: bool) -> tuple[str, ...]:
    """What the outcome says became of the training state after the reruns."""
    if trained.empty or len(outcome.tries) == 0:
        return ()
    names = trained.describe()
    if restorer is None:
        return (f"the reruns' training steps stayed in {names}: their state was not put back",)
    if last_fitted:
        return (f"{names} put back before each rerun: as one run of the cell that fitted leaves them",)
    return (f"{names} put back as they were before the reruns",)
