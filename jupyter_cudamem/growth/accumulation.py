"""Gradient accumulation: how to keep an effective batch with micro-batches that fit. One rule, used by
``%oomfix``'s advice and by ``%%cudamem_plan``'s table. Pure arithmetic."""

from __future__ import annotations

import math
from dataclasses import dataclass


# A divisor of the effective batch is "close" to the batch that fitted when it is at least this fraction of
# it: it costs at most about twice the fewest passes. Below, an exact split may cost far more (1021, a prime,
# with 300 fitting: 1021 passes of 1), so the plan offers an uneven last step or a rounded effective batch.
CLOSE_DIVISOR_FRACTION = 0.5


@dataclass(frozen=True)
class AccumulationPlan:
    """How to keep an effective batch of ``effective`` samples per optimizer step with micro-batches of at
    most ``fitted``: ``exact``, ``micro * steps == effective``; otherwise ``(steps - 1) * micro + last ==
    effective``, and ``rounded_effective`` is the alternative with equal steps.
    """

    effective: int
    fitted: int
    micro: int
    steps: int
    last: int
    exact: bool

    @property
    def rounded_effective(self) -> int:
        return self.micro * self.steps


def largest_divisor_at_most(number: int, limit: int) -> int:
    """The largest divisor of ``number`` that is at most ``limit`` (1 at least)."""
    best = 1
    root = math.isqrt(number)
    for small in range(1, root + 1):
        if number % small == 0:
            for divisor in (small, number // small):
                if best < divisor <= limit:
                    best = divisor
    return best


def accumulation_plan(batch_before: int, batch_fits: int) -> AccumulationPlan:
    """Keep the effective batch ``batch_before`` with micro-batches of at most ``batch_fits``: its largest
    divisor that fits, unless that is not close (``CLOSE_DIVISOR_FRACTION``), then ``batch_fits`` and a last one."""
    effective = max(batch_before, 1)
    fitted = max(min(batch_fits, effective), 1)
    divisor = largest_divisor_at_most(effective, fitted)
    if divisor >= fitted * CLOSE_DIVISOR_FRACTION:
        return AccumulationPlan(effective, fitted, divisor, effective // divisor, divisor, exact=True)
    steps = math.ceil(effective / fitted)
    return AccumulationPlan(effective, fitted, fitted, steps, effective - (steps - 1) * fitted, exact=False)
