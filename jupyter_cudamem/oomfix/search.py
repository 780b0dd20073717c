"""Choose the next batch size to try from measured peaks, so few reruns land near the largest that fits.

Why a line: the memory a training or inference step needs above what was allocated before it is
close to linear in the batch size (measured on an H100, torch 2.11, one Adam step: a line through two small
batches predicted every larger peak within 0.6% for a CNN and a transformer; tests/oomfix/test_search.py
models that CNN, benchmarks/oomfix.py measures the search on a real card). So:

1. The failed batch tells us only that it is too big. Probe well below it (a sixteenth: a cell written
   8x too big is probed at half the largest batch that fits), which nearly always fits.
2. One measured point: assume the line passes through the origin. Peak above start has a
   non-negative intercept, so this overestimates the slope and the predicted batch errs small.
3. Two or more points: least squares through them; predict the largest batch whose peak stays under
   the budget less a safety margin, and try it, which confirms it.
4. A try that contradicts the line (fails where the line said it fits) is read by what it managed to
   hold before failing: less than the line predicts means the budget was smaller than measured
   (the allocator's rounding and blocks it cannot reuse, memory outside PyTorch). The usable budget
   then lies between what the failed try held (usable for certain) and what the line predicted for
   it (too much), so it becomes their midpoint and the line predicts again. As much as the line
   predicts means the peak grows faster than a line, and so does a second contradiction: then
   bisection between the largest batch that fitted and the smallest that failed.

The line is fitted on allocated peaks. Reserved peaks (what a cap really limits) were tried on the
H100 and are useless under a cap: cuDNN asks for the largest convolution workspace first and settles
for less when refused, so a CNN's reserved peak reached the 6 GiB cap at a batch needing 3 GiB.

Pure arithmetic: no torch, no IPython. Sizes in bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Attempt:
    """One try: the batch, whether it fitted, its peak above the start, and why it was chosen."""

    batch: int
    fitted: bool
    peak_bytes: int | None  # measured peak above the start; for a failure only what it reached
    reason: str


@dataclass(frozen=True)
class Line:
    """Peak above the start as ``slope_bytes * batch + intercept_bytes``."""

    slope_bytes: float
    intercept_bytes: float

    def peak(self, batch: float) -> float:
        return self.slope_bytes * batch + self.intercept_bytes

    def largest_batch(self, budget_bytes: float) -> int:
        if self.slope_bytes <= 0:
            return 0
        return max(int(math.floor((budget_bytes - self.intercept_bytes) / self.slope_bytes)), 0)


def fit_line(points: list[tuple[int, int]], min_spread: float = 0.15) -> Line | None:
    """Least squares through (batch, peak); through the origin when the batches are too close.

    Two batches within ``min_spread`` of each other give a slope dominated by noise; the line
    through the origin and the largest point is then the safer estimate.
    """
    usable = [(b, p) for b, p in points if b > 0 and p is not None and p >= 0]
    if not usable:
        return None
    batches = [b for b, _ in usable]
    if len(set(batches)) >= 2 and (max(batches) - min(batches)) >= min_spread * max(batches):
        n = len(usable)
        mean_b = sum(batches) / n
        mean_p = sum(p for _, p in usable) / n
        sxx = sum((b - mean_b) ** 2 for b in batches)
        sxy = sum((b - mean_b) * (p - mean_p) for b, p in usable)
        slope = sxy / sxx
        intercept = mean_p - slope * mean_b
        if slope > 0 and intercept >= -0.05 * mean_p:
            return Line(slope, intercept)
    batch, peak = max(usable)
    if peak <= 0:
        return None
    return Line(peak / batch, 0.0)


@dataclass
class BatchSearch:
    """The policy, fed one try at a time: ``next_batch()``, run it, ``record(...)``, repeat.

    ``failed_batch`` is the batch the cell failed with (not counted as a try); ``budget_bytes`` is
    what the cell may use above what is allocated when it starts (free memory within any per-process
    cap, measured after cleanup). ``max_tries`` bounds the reruns; ``margin`` is the fraction of the
    budget kept free when predicting; a gain below ``min_gain`` is not worth a rerun.
    """

    failed_batch: int
    budget_bytes: int
    max_tries: int = 3
    margin: float = 0.04
    min_gain: float = 0.03
    probe_divisor: int = 16
    min_batch: int = 1
    attempts: list[Attempt] = field(default_factory=list)
    _contradictions: int = 0
    _budget_limit: float | None = None  # lowered when a try fails where the line said it fits

    def __post_init__(self) -> None:
        if self.failed_batch < 2:
            raise ValueError(f"a batch of {self.failed_batch} cannot be made smaller")
        if self.max_tries < 1:
            raise ValueError("max_tries must be at least 1")

    # -- what we know ------------------------------------------------------------------------
    @property
    def best(self) -> int | None:
        """The largest batch that fitted."""
        fitted = [a.batch for a in self.attempts if a.fitted]
        return max(fitted) if fitted else None

    @property
    def smallest_failed(self) -> int:
        return min([self.failed_batch] + [a.batch for a in self.attempts if not a.fitted])

    def line(self) -> Line | None:
        return fit_line([(a.batch, a.peak_bytes) for a in self.attempts if a.fitted and a.peak_bytes is not None])

    def effective_budget(self) -> float:
        """The budget, corrected by what the tries showed (a fit above it, a failure below it)."""
        budget = float(self.budget_bytes)
        peaks = [a.peak_bytes for a in self.attempts if a.fitted and a.peak_bytes is not None]
        if peaks:
            budget = max(budget, float(max(peaks)))
        if self._budget_limit is not None:
            budget = min(budget, self._budget_limit)
        return budget

    # -- the policy ----------------------------------------------------------------------------
    def next_batch(self) -> int | None:
        """The batch to try next, or ``None`` when tries are spent or nothing better is left."""
        choice = self._choose()
        return None if choice is None else choice[0]

    def _choose(self) -> tuple[int, str] | None:
        if len(self.attempts) >= self.max_tries:
            return None
        low = self.best or 0
        high = self.smallest_failed
        if high - low <= 1 or high <= self.min_batch:
            return None
        line = self.line()
        if line is None:
            # Nothing fitted with a measured peak yet: probe far below the smallest failure.
            if low:
                return self._bounded((low + high) // 2, low, high, "bisection (no peak measured)")
            divisor = self.probe_divisor if not self.attempts else 4  # a failed probe was already far down
            return self._bounded(max(high // divisor, self.min_batch), low, high, "probe")
        if self._contradictions >= 2:
            return self._bounded((low + high) // 2, low, high, "bisection (the line was contradicted twice)")
        budget = self.effective_budget()
        predicted = line.largest_batch(budget * (1 - self.margin))
        how = "line through origin" if line.intercept_bytes == 0 else "line through measured peaks"
        if predicted >= high:
            predicted = high - 1
        if predicted <= low * (1 + self.min_gain):
            return None  # the line says the best fit is already (about) the largest that fits
        return self._bounded(predicted, low, high, f"{how}: {line.slope_bytes / 2**20:.3f} MiB per item")

    def _bounded(self, batch: int, low: int, high: int, reason: str) -> tuple[int, str] | None:
        batch = min(max(batch, low + 1, self.min_batch), high - 1)
        if batch <= low or batch >= high:
            return None
        return batch, reason

    def record(self, batch: int, fitted: bool, peak_bytes: int | None = None, reason: str | None = None) -> Attempt:
        """Record a try's outcome; ``peak_bytes`` is its measured peak above the start."""
        if reason is None:
            choice = self._choose()
            reason = choice[1] if choice is not None and choice[0] == batch else "chosen by the caller"
        line = self.line()
        if not fitted and line is not None:
            predicted_peak = line.peak(batch)
            if predicted_peak <= self.effective_budget():
                self._contradictions += 1
                if peak_bytes is not None and peak_bytes >= predicted_peak * (1 - self.margin):
                    # It held as much as the line says it needs and still wanted more: the peak grows
                    # faster than the line, so the line cannot place the limit; bisect.
                    self._contradictions = max(self._contradictions, 2)
                else:
                    # The line may be right and the budget wrong (fragmentation, memory outside
                    # PyTorch): what the failed try held is usable for certain, what the line gave it
                    # is too much; the limit lies between. Their midpoint came within 8% of the
                    # largest CNN batch that fits on the H100 (benchmarks/oomfix.py), the held
                    # figure alone within 15%.
                    held = peak_bytes if peak_bytes is not None else predicted_peak * (1 - 4 * self.margin)
                    limit = (held + predicted_peak) / 2
                    if self._budget_limit is not None:
                        limit = min(limit, self._budget_limit)
                    self._budget_limit = float(limit)
        attempt = Attempt(batch, fitted, peak_bytes, reason)
        self.attempts.append(attempt)
        return attempt

    def run(self, try_batch) -> int | None:  # type: ignore[no-untyped-def]
        """Drive the whole search with ``try_batch(batch) -> (fitted, peak_bytes)``; return the best."""
        while True:
            choice = self._choose()
            if choice is None:
                return self.best
            batch, reason = choice
            fitted, peak = try_batch(batch)
            self.record(batch, fitted, peak, reason)
