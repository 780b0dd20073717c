"""The plan's calibration search (``%%cudamem_plan --calibrate``): the largest batch that fits, by running
the cell, from a guess. Steps by a factor until one batch fits and one does not, then halves the gap
until they are within a resolution of each other. Pure: ``fits`` runs the cell.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Bracket:
    """What the search found: the largest batch that fitted and the smallest that did not (``None``:
    none), and the runs it took."""

    fitted: int | None
    failed: int | None
    runs: int


def bracket_largest(fits: Callable[[int], bool | None], guess: int, max_runs: int, step: float,
                    resolution: float) -> Bracket:
    """Run ``fits(batch)`` (``True``: it fitted; ``False``: out of memory; ``None``: another error, which
    ends the search and whose words the caller keeps) from ``guess``, stepping by ``step`` up after a fit
    and down after a failure until both are seen, then bisecting to within ``resolution`` of the batch."""
    fitted: int | None = None
    failed: int | None = None
    runs = 0
    batch = guess
    while runs < max_runs:
        if fitted is not None and failed is not None:
            if failed - fitted <= max(1, int(fitted * resolution)):
                break
            batch = (fitted + failed) // 2
        elif fitted is not None:
            batch = max(int(fitted * step), fitted + 1)
        elif failed is not None:
            if failed == 1:
                break
            batch = max(int(failed / step), 1)
        runs += 1
        answer = fits(batch)
        if answer is None:
            break
        if answer:
            fitted = batch
        else:
            failed = batch
    return Bracket(fitted, failed, runs)
