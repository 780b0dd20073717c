"""What ``%oomfix`` says to the user and asks of them: the question before rerunning (the cell's side
effects repeat; what becomes of the training state), and the outcome shown, with how to keep the cell
that fitted."""

from __future__ import annotations

from typing import TYPE_CHECKING

from IPython.display import display

from ..errors import CudaMemError
from ..oomfix.outcome import Outcome

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

    from ..reruns.model_state import TrainingState

_SIDE_EFFECTS = (
    "%oomfix reruns the cell (up to {tries} times): anything it does outside the notebook (writing files, "
    "printing) happens again."
)
_RESTORED = " The model and optimizer state it trains ({names}) is put back before each rerun."
_NOT_RESTORED = " The reruns' training steps stay in {names} (--no-restore)."


_PLAIN = " The lists, dicts and variables it changes are put back before each rerun."


def state_note(trained: TrainingState, restore: bool, too_large: str | None) -> str:
    """What the question before rerunning says of the training state and the plain values."""
    plain = "" if trained.plain.empty else _PLAIN
    if trained.empty:
        return plain
    if restore:
        return _RESTORED.format(names=trained.describe()) + plain
    if too_large is not None:
        return f" Note: {too_large}." + plain
    return _NOT_RESTORED.format(names=trained.describe())


def confirmed(max_tries: int, state_note: str = "") -> bool:
    """Ask before rerunning; where nobody can be asked, one line saying to add --yes."""
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


def show(outcome: Outcome, apply: bool, shell: InteractiveShell) -> None:
    """Display the outcome (its third line says where the change is); with ``--apply``, put the cell that
    fitted in the next input."""
    display(outcome)
    if outcome.changed and apply and not outcome.dry_run:
        shell.set_next_input(outcome.paste, replace=False)
