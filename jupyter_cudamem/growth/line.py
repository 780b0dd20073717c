"""How a step's peak GPU memory grows with its batch size: ``fixed + per_sample x batch``, fitted from measurements.

Pure arithmetic on bytes; knows nothing of IPython, PyTorch or the search that uses it.

Why a line: a training or inference step's peak above what was allocated before it is the sum of the
tensors alive at its peak; activations, their gradients and the inputs grow with the batch, while
weights, gradients of weights, optimizer state and workspaces built in the step do not. Not every cell
is linear (dynamic shapes, caches that grow), which is why a prediction is always confirmed by a run
before it is reported.

Why an uncertainty: PyTorch's caching allocator rounds each allocation above 1 MiB up to a multiple of
``ALLOCATOR_BLOCK_BYTES``, so a peak is the line plus up to one block per large live tensor, and it
jumps in steps as the batch grows. Two peaks close together therefore give a slope that may be off by
``2 x PEAK_UNCERTAINTY_BYTES / (spread of the batches)``; ``Growth.per_sample_high_bytes`` is the
steepest slope the measurements allow, which is what a prediction that must fit uses.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..units import MiB
from .through_points import least_squares

ALLOCATOR_BLOCK_BYTES = 2 * MiB
"""PyTorch's caching allocator rounds allocations above 1 MiB up to 2 MiB multiples (``kRoundLarge``)."""

PEAK_UNCERTAINTY_BYTES = 2 * ALLOCATOR_BLOCK_BYTES
"""How far one measured peak may sit from the line. Each large tensor alive at the peak is rounded up
by less than a 2 MiB block, so with k of them the peak sits 0 to 2k MiB above the line, and the
difference between two peaks (what a slope is made of) varies by about 2 MiB x sqrt(k / 6): 2.3 MiB
for 8 tensors, 3.7 MiB for 20. Two blocks per point covers that at 1.5 to 2 standard deviations:
enough that rounding alone rarely makes a predicted batch fail, small enough that a probe a few dozen
samples wide still gives a usable slope."""

PEAK_UNCERTAINTY_FRACTION = 0.001
"""The same, relative: peaks measured twice at one batch differ by a fraction of a percent (cuDNN or
cuBLAS picking another algorithm and workspace); 0.1% of the peak covers that."""


def uncertainty(peak_bytes: float) -> float:
    """How far a measured peak of ``peak_bytes`` may be from the line (see the constants)."""
    return max(PEAK_UNCERTAINTY_BYTES, PEAK_UNCERTAINTY_FRACTION * peak_bytes)


@dataclass(frozen=True)
class Growth:
    """Peak above the start as ``fixed_bytes + per_sample_bytes x batch``.

    ``per_sample_high_bytes`` is the steepest slope the measurements allow (rounding included);
    ``anchor`` the measured point predictions extrapolate from (the largest batch measured), so an
    error in the slope costs only over the distance from it.
    """

    fixed_bytes: float
    per_sample_bytes: float
    per_sample_high_bytes: float
    anchor: tuple[int, float]

    def peak(self, batch: float) -> float:
        """The predicted peak at ``batch``, from the anchor with the fitted slope."""
        b, p = self.anchor
        return p + self.per_sample_bytes * (batch - b)

    def peak_high(self, batch: float) -> float:
        """The highest peak at ``batch`` (``batch`` above the anchor) the measurements allow."""
        b, p = self.anchor
        return p + uncertainty(p) + self.per_sample_high_bytes * max(batch - b, 0)

    def raised(self, by_bytes: float) -> Growth:
        """The same line for a step that starts ``by_bytes`` higher (state kept from earlier steps)."""
        batch, peak = self.anchor
        return Growth(self.fixed_bytes + by_bytes, self.per_sample_bytes, self.per_sample_high_bytes,
                      (batch, peak + by_bytes))

    def steeper(self, by_bytes_per_sample: float) -> Growth:
        """The same line with ``by_bytes_per_sample`` more per sample (memory that grows with the batch
        but that the measured peaks do not include: the allocator's unusable fragments)."""
        if by_bytes_per_sample <= 0:
            return self
        batch, peak = self.anchor
        return Growth(self.fixed_bytes, self.per_sample_bytes + by_bytes_per_sample,
                      self.per_sample_high_bytes + by_bytes_per_sample, (batch, peak + by_bytes_per_sample * batch))

    def largest_batch(self, budget_bytes: float, sure: bool = True) -> int:
        """The largest batch whose peak stays within ``budget_bytes``: with the steepest slope allowed
        (``sure``) or the fitted one."""
        b, p = self.anchor
        slope = self.per_sample_high_bytes if sure else self.per_sample_bytes
        room = budget_bytes - p - (uncertainty(p) if sure else 0.0)
        if slope <= 0:
            return b if room >= 0 else 0
        return max(int(math.floor(b + room / slope)), 0)


def through_origin(batch: int, peak_bytes: float) -> Growth:
    """The steepest line one measured point allows: through it and ``fixed = 0``.

    A step's batch-independent part is never negative, so for batches above ``batch`` the peak is at
    most ``peak_bytes x b / batch``: a prediction from this line fits (up to rounding), whatever the
    real fixed part is. It errs small when the fixed part is large."""
    slope = peak_bytes / batch
    return Growth(0.0, slope, slope, (batch, peak_bytes))


def through_fixed(batch: int, peak_bytes: float, fixed_bytes: float) -> Growth:
    """The steepest line one measured point allows when ``fixed_bytes`` are held at every moment of the
    run whatever the batch (the parameters of a model the cell builds): through the point and
    ``(0, fixed_bytes)``.

    Why it is still sure: a run's peak is the highest of its phases (forward, backward, optimizer step),
    each a line in the batch whose batch-independent part holds at least ``fixed_bytes``; at ``batch``
    every phase is at most the measured peak, so each grows by at most ``(peak - fixed) / batch`` per
    sample, the phase that set the peak or any other. With ``fixed_bytes`` 0 this is ``through_origin``."""
    if not 0 < fixed_bytes < peak_bytes:
        return through_origin(batch, peak_bytes)
    slope = (peak_bytes - fixed_bytes) / batch
    return Growth(fixed_bytes, slope, slope, (batch, peak_bytes))


def fit(points: Iterable[tuple[int, float]]) -> Growth | None:
    """The line through measured ``(batch, peak_bytes)`` points, least squares, with its steepest slope.

    One point, or a slope the rounding allows to be as steep as the line through the origin: that line.
    A fitted fixed part below zero is noise: the line through the origin and the largest point is then
    the steepest allowed and is used.
    """
    usable = sorted({(int(b), float(p)) for b, p in points if b > 0 and p is not None and p >= 0})
    if not usable:
        return None
    batches = [b for b, _ in usable]
    top = max(usable)
    if len(set(batches)) < 2:
        return through_origin(*top)
    slope, mean_b, mean_p = least_squares(usable)
    spread = max(batches) - min(batches)
    # A slope below zero is rounding (a peak never shrinks with the batch): the points then say only
    # that the slope is small, at most what the uncertainty of two points over their spread allows.
    slope = max(slope, 0.0)
    # The steepest slope the points allow when each may sit ``uncertainty`` off the line.
    high = slope + (uncertainty(top[1]) + uncertainty(min(usable)[1])) / spread
    origin = top[1] / top[0]
    if high >= origin:
        return through_origin(*top)  # rounding hides the slope: the origin line is the safe bound
    fixed = mean_p - slope * mean_b
    if fixed < 0:
        return through_origin(*top)
    return Growth(fixed, slope, high, top)


def lowest_slope(fitted: Sequence[tuple[int, float]], failed: Sequence[tuple[int, float]]) -> float:
    """The least per-sample growth the tries allow: from a fitted point ``(b, p)`` to a failure at ``B``
    that needed at least ``L`` bytes, the peak grew at least ``(L - p) / (B - b)`` per sample."""
    best = 0.0
    for b, p in fitted:
        for big, need in failed:
            if big > b and need > p:
                best = max(best, (need - p) / (big - b))
    return best
