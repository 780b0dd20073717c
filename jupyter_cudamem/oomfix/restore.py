"""What ``%oomfix``'s outcome says became of the model and optimizer state a failed cell trains and of the
plain values it changes, put back around its reruns. Whether they are copied, and the copying itself, are
``reruns.model_state``'s."""

from __future__ import annotations

from typing import Any

from .outcome import Outcome


def restore_notes(trained: Any, restorer: Any, outcome: Outcome, last_fitted: bool) -> tuple[str, ...]:
    """What the outcome says became of the training state and the plain values after the reruns."""
    if len(outcome.tries) == 0:
        return ()
    notes: list[str] = []
    put_back = (" put back before each rerun: as one run of the cell that fitted leaves them" if last_fitted
                else " put back as they were before the reruns")
    if not trained.empty:
        if restorer is None or not restorer.copy_training:
            notes.append(f"the reruns' training steps stayed in {trained.describe()}: their state was not put back")
        else:
            notes.append(trained.describe() + put_back)
    plain = trained.plain
    if restorer is not None and plain.changed:
        notes.append(", ".join(plain.changed) + put_back)
    if restorer is not None and restorer.unrestored:
        notes.append(f"could not be put back, so the reruns' changes stay: {'; '.join(restorer.unrestored)}")
    if restorer is not None and plain.too_large:
        notes.append(f"too large to copy, so not put back where the reruns changed them: {', '.join(plain.too_large)}")
    return tuple(notes)
