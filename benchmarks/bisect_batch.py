"""The largest batch that fits, found by real runs: step from a start until the answer flips, then bisect.

Both device benchmarks that need the true largest batch find it this way, each with its own steps:
``benchmarks/oomfix.py`` doubles from a small batch (its oracle), ``benchmarks/plan.py`` moves by 25%
from the plan's prediction (so a good prediction costs few runs). The rule they share lives here:
fitting is taken as monotone in the batch (a run near the limit that fits once may fail once: the
answer is each run's word), every run is recorded, and the answer is a batch that fitted whose next
batch up failed, or 0 when not even a batch of 1 fits.

Pure Python over ``fits(batch) -> bool``; ``tests/test_benchmark_bisect.py`` checks it on CPU.
"""

from __future__ import annotations

from collections.abc import Callable


def largest_fitting(
    fits: Callable[[int], bool],
    start: int,
    up: Callable[[int], int],
    down: Callable[[int], int] | None = None,
    limit: int | None = None,
    failing: int | None = None,
) -> tuple[int, list[tuple[int, bool]]]:
    """The largest batch ``fits`` accepts, and every ``(batch, fitted)`` run in the order made.

    From ``start``: while it fits, try ``up(batch)`` (larger) until one fails; if ``start`` fails, try
    ``down(batch)`` (smaller, at least 1; 0 to stop) until one fits, or, without ``down``, bisect from 0.
    Then bisect between the last batch that fitted and the first that failed. Steps up that pass
    ``limit`` with every run fitting raise ``RuntimeError``: the batch does not reach what the runs allocate.
    ``failing``: a batch already known not to fit (a stricter test's bound from a looser one's answer):
    it is never run, and no step goes at or past it.
    """
    if start < 1:
        raise ValueError(f"the first batch must be at least 1, got {start}")
    runs: list[tuple[int, bool]] = []

    def run(batch: int) -> bool:
        fitted = fits(batch)
        runs.append((batch, fitted))
        return fitted

    if failing is not None and start >= failing:
        raise ValueError(f"the first batch {start} is at or above the batch known to fail, {failing}")

    def step_up(batch: int) -> int:
        return up(batch) if failing is None else min(up(batch), failing)

    if run(start):
        low, high = start, step_up(start)
        while (limit is None or high <= limit) and high != failing and run(high):
            low, high = high, step_up(high)
        if limit is not None and high > limit:
            raise RuntimeError(f"still fits at {low}: the batch knob does not reach the cell")
    else:
        low, high = 0, start
        while down is not None and (smaller := down(high)) >= 1:
            if run(smaller):
                low = smaller
                break
            high = smaller
    while high - low > 1:
        middle = (low + high) // 2
        if run(middle):
            low = middle
        else:
            high = middle
    return low, runs
