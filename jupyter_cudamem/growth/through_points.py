"""The line through measured peaks, exactly, and how far the measurements agree with it: what
``%%cudamem_plan`` fits and reports. ``line.Growth`` is the same line with the steepest slope the
allocator's rounding allows, what ``%oomfix``'s search must use because a batch it picks must fit; the plan
must not hide a line that disagrees with its points, so none of the search's safety fallbacks apply here.

Peak memory in a cell is close to linear in the batch size: the batch's activations, gradients of
activations and inputs grow with it, while weights, gradients of weights, optimizer state and
workspaces do not. ``benchmarks/plan.py`` puts it to the test: it predicts, from two runs, the largest
batch of four kinds of workload under caps playing 16, 24 and 40 GiB cards, and finds the real one. So

    peak = fixed_bytes + per_sample_bytes x batch

where ``peak`` is PyTorch's allocated peak during the cell, *including* what was allocated when the
cell started (a model and optimizer state built in earlier cells are there on any card).

Pure arithmetic: sizes in bytes, no torch, no IPython.
"""

from __future__ import annotations

from collections.abc import Sequence
import math
from dataclasses import dataclass

from ..units import MiB

REPEAT_TOLERANCE = 0.03
"""Two runs of one cell at one batch agree when their peaks above the start differ by at most this
fraction (plus ``REPEAT_SLACK_BYTES``). A deterministic cell repeats its allocated peak to the byte;
what moves it is a library choosing another algorithm and workspace between runs (cuDNN, cuBLAS),
a few MiB, or a cell whose work changes run to run, which a line cannot plan."""

REPEAT_SLACK_BYTES = 4 * MiB
"""Absolute slack for tiny cells, where one workspace of a few MiB is a large fraction."""


@dataclass(frozen=True)
class Line:
    """Peak as ``slope_bytes * batch + intercept_bytes``: bytes per sample and the batch-independent part."""

    slope_bytes: float
    intercept_bytes: float

    def peak(self, batch: float) -> float:
        return self.slope_bytes * batch + self.intercept_bytes

    def largest_batch(self, budget_bytes: float) -> int:
        """The largest batch whose peak stays within ``budget_bytes`` (0 when none does)."""
        if self.slope_bytes <= 0:
            return 0
        return max(int(math.floor((budget_bytes - self.intercept_bytes) / self.slope_bytes)), 0)


@dataclass(frozen=True)
class Agreement:
    """How one measurement compares with the line: ``relative`` is (measured - predicted) / predicted."""

    label: str
    batch: int
    measured_bytes: int
    predicted_bytes: float

    @property
    def relative(self) -> float:
        return (self.measured_bytes - self.predicted_bytes) / self.predicted_bytes if self.predicted_bytes else 0.0


def least_squares(points: Sequence[tuple[int, float]]) -> tuple[float, float, float]:
    """The least-squares slope through ``(batch, peak_bytes)`` points of at least two distinct batches, with
    the points' mean batch and mean peak (the line runs through them): the one fit the plan's line and the
    search's ``line.fit`` share."""
    batches = [b for b, _ in points]
    n = len(points)
    mean_b = sum(batches) / n
    mean_p = sum(p for _, p in points) / n
    sxx = sum((b - mean_b) ** 2 for b in batches)
    sxy = sum((b - mean_b) * (p - mean_p) for b, p in points)
    return sxy / sxx, mean_b, mean_p


def fit(points: Sequence[tuple[int, int]]) -> Line:
    """Least squares through ``(batch, peak_bytes)`` points of at least two distinct batches."""
    if len({b for b, _ in points}) < 2:
        raise ValueError("a line needs peaks at two different batch sizes")
    slope, mean_b, mean_p = least_squares(points)
    return Line(slope, mean_p - slope * mean_b)


def same(first_bytes: int, second_bytes: int, start_bytes: int = 0) -> bool:
    """Whether two peaks of one cell at one batch agree (see ``REPEAT_TOLERANCE``)."""
    own = max(first_bytes, second_bytes) - start_bytes
    return abs(first_bytes - second_bytes) <= REPEAT_TOLERANCE * max(own, 0) + REPEAT_SLACK_BYTES


def faster_than_linear(line: Line, start_bytes: int, peak_bytes: int) -> bool:
    """Whether the line's fixed part lies below what was allocated before the cell started.

    At batch 0 the cell holds at least what it started with, so a fitted intercept below that means
    the larger batch needed more than its share: peak grows faster than the batch (a batch x batch
    similarity matrix, a cache that grows with it). The two points' own noise, extrapolated to 0,
    is allowed twice over.
    """
    own = max(peak_bytes - start_bytes, 0)
    return line.intercept_bytes < start_bytes - 2 * (REPEAT_TOLERANCE * own + REPEAT_SLACK_BYTES)
