"""A cell's peak GPU memory as a line in its batch size, ``fixed + per_sample x batch``, and what does not grow.

Pure arithmetic on bytes. Why a line: a step's peak is the sum of the tensors alive at it; activations and
inputs grow with the batch, weights, their gradients and optimizer state do not. Not every cell is linear,
which is why a prediction is confirmed by a run before it is reported.

``Line`` runs exactly through the measured peaks (``Agreement``): what ``%%cudamem_plan`` reports, and must
not hide. ``Growth`` takes the steepest slope the allocator's rounding allows, because a batch ``%oomfix``
picks must fit. ``FixedMemory`` is what does not grow, read from the objects a cell trains; in a fine-tune it
is most of the memory, and which recorded requests are it is read from their sizes and lifetimes
(``batch_independent_requests``). Each request on a line of its own (``EventLine``) is what the replay plays
at a batch never run (``events_at``), below the bound the allocated bytes alone set (``allocated_limit``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from ..units import MiB
from .replay import ALLOC, FREE, Event, EventKind, block_bytes

REPEAT_TOLERANCE = 0.03
"""Two runs of one cell at one batch agree when their peaks above the start differ by at most this
fraction (plus ``REPEAT_SLACK_BYTES``): a deterministic cell repeats its peak but for a library choosing
another workspace (a few MiB); more is a cell whose work changes run to run, which a line cannot plan."""

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
    their mean batch and mean peak (the line runs through them): the fit ``line_through`` and ``fit`` share."""
    batches = [b for b, _ in points]
    n = len(points)
    mean_b = sum(batches) / n
    mean_p = sum(p for _, p in points) / n
    sxx = sum((b - mean_b) ** 2 for b in batches)
    sxy = sum((b - mean_b) * (p - mean_p) for b, p in points)
    return sxy / sxx, mean_b, mean_p


def line_through(points: Sequence[tuple[int, int]]) -> Line:
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
    """Whether the line's fixed part lies below what was allocated before the cell started (with twice the
    points' noise): at batch 0 the cell holds at least that, so its peak grows faster than the batch."""
    own = max(peak_bytes - start_bytes, 0)
    return line.intercept_bytes < start_bytes - 2 * (REPEAT_TOLERANCE * own + REPEAT_SLACK_BYTES)


ALLOCATOR_BLOCK_BYTES = 2 * MiB
"""PyTorch's caching allocator rounds allocations above 1 MiB up to 2 MiB multiples (``kRoundLarge``)."""

PEAK_UNCERTAINTY_BYTES = 2 * ALLOCATOR_BLOCK_BYTES
"""How far one measured peak may sit from the line: each of k large live tensors is rounded up by less than
a block, so two peaks differ by about 2 MiB x sqrt(k / 6) (3.7 MiB for 20). Two blocks cover that at 1.5 to 2
standard deviations, yet a probe a few dozen samples wide still gives a usable slope."""

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
    """The steepest line one measured point allows: through it and ``fixed = 0``, since a fixed part is
    never negative. It errs small when the fixed part is large."""
    slope = peak_bytes / batch
    return Growth(0.0, slope, slope, (batch, peak_bytes))


def through_fixed(batch: int, peak_bytes: float, fixed_bytes: float) -> Growth:
    """The steepest line one measured point allows when ``fixed_bytes`` are held at every moment of the run
    (the parameters of a model the cell builds): through the point and ``(0, fixed_bytes)``. Still sure:
    every phase holds them and is at most the peak at ``batch``, so none grows by more than this slope."""
    if not 0 < fixed_bytes < peak_bytes:
        return through_origin(batch, peak_bytes)
    slope = (peak_bytes - fixed_bytes) / batch
    return Growth(fixed_bytes, slope, slope, (batch, peak_bytes))


def fit(points: Iterable[tuple[int, float]]) -> Growth | None:
    """The line through measured ``(batch, peak_bytes)`` points, least squares, with its steepest slope;
    ``through_origin`` of the largest point where there is one batch, the steepest slope reaches that line's,
    or the fitted fixed part is below zero (noise)."""
    usable = sorted({(int(b), float(p)) for b, p in points if b > 0 and p is not None and p >= 0})
    if not usable:
        return None
    batches = [b for b, _ in usable]
    top = max(usable)
    if len(set(batches)) < 2:
        return through_origin(*top)
    slope, mean_b, mean_p = least_squares(usable)
    spread = max(batches) - min(batches)
    slope = max(slope, 0.0)  # below zero is rounding: a peak never shrinks with the batch
    high = slope + (uncertainty(top[1]) + uncertainty(min(usable)[1])) / spread
    origin = top[1] / top[0]
    if high >= origin:
        return through_origin(*top)
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


@dataclass(frozen=True)
class FixedMemory:
    """The batch-independent part of a step, above the search's reference level, in bytes.

    ``parameters_bytes``: parameters and buffers of models the cell builds again (allocated by every run);
    ``gradients_bytes`` and ``optimizer_state_bytes``: what the step's first ``backward()`` and ``step()`` will
    create; ``tensor_bytes``: the sizes of single parameter tensors and their half-precision copies, so that a
    request of one is taken as a parameter's, a gradient's or the state's, not a batch's; ``gradient_sizes``,
    ``trainable_sizes``, ``state_sizes``, ``built_sizes``: each gradient the step will create, parameter it
    trains, state tensor it will create, parameter or buffer the cell builds; ``trains``: whether the step
    runs a backward pass and an optimizer's step.
    """

    parameters_bytes: int = 0
    gradients_bytes: int = 0
    optimizer_state_bytes: int = 0
    tensor_bytes: frozenset[int] = field(default_factory=frozenset)
    gradient_sizes: tuple[int, ...] = ()
    trainable_sizes: tuple[int, ...] = ()
    state_sizes: tuple[int, ...] = ()
    built_sizes: tuple[int, ...] = ()
    trains: bool = False

    @property
    def total_bytes(self) -> int:
        """All of it: what a step holds at its optimizer step, before its batch's tensors."""
        return self.parameters_bytes + self.gradients_bytes + self.optimizer_state_bytes

    @property
    def surely_held_bytes(self) -> int:
        """What every moment of a run holds after its model is built: the parameters it builds (gradients
        and state exist only from the backward pass on)."""
        return self.parameters_bytes

    def is_parameter_sized(self, requested_bytes: int) -> bool:
        """Whether a request is the size of a parameter tensor (so its own, its gradient's or its state's)."""
        return block_bytes(requested_bytes) in self._blocks

    @cached_property
    def _blocks(self) -> frozenset[int]:
        return frozenset(block_bytes(size) for size in self.tensor_bytes if size > 0)


def made_in_steps(events: Sequence[Event], steps: Sequence[tuple[int, int]]) -> frozenset[int]:
    """The keys of the requests made within ``steps`` (``(first event, event after the last)`` of each marked
    optimizer ``step()``): its state and temporaries, the parameters' size at every batch."""
    return frozenset(events[index][1] for first, after in steps for index in range(first, min(after, len(events)))
                     if events[index][0] != FREE)


def step_gradients(events: Sequence[Event], fixed: FixedMemory, steps: Sequence[tuple[int, int]]) -> frozenset[int]:
    """Of each marked step, the keys of the gradients it applies: the parameter-sized requests made since the
    previous step that are still allocated when it begins (a weight-sized activation is freed by then), the
    latest first, at most as many of each size as the step trains parameters."""
    trained = fixed.trainable_sizes or fixed.gradient_sizes
    freed_at = {key: index for index, (kind, key, _, _) in enumerate(events) if kind == FREE}
    found: set[int] = set()
    since = 0
    for first, after in steps:
        wanted = Counter(block_bytes(size) for size in trained if size > 0)
        for index in range(min(first, len(events)) - 1, since - 1, -1):
            kind, key, size, _ = events[index]
            block = block_bytes(size)
            if kind != FREE and wanted[block] > 0 and freed_at.get(key, len(events)) >= first:
                found.add(key)
                wanted[block] -= 1
        since = after
    return frozenset(found)


def batch_independent_requests(events: Sequence[Event], left: Collection[int], fixed: FixedMemory,
                               steps: Sequence[tuple[int, int]] = ()) -> frozenset[int]:
    """The keys of one recorded run's parameter-sized requests that do not grow with the batch, read from
    their lifetimes (the rest is taken as proportional: ``fitting.fitting_from_one``):

    - those the run left allocated (``left``): the optimizer's state, a model the cell built, kept gradients;
    - the gradients: of each size, as many as ``gradient_sizes`` says, those freed last (a weight-sized
      activation is freed within the backward pass, a gradient lives through the step);
    - the step's: those made after the last gradient, from the step's first state tensor, or where it made
      none from the backward pass's last free of a weight-sized tensor while the gradients live.

    Marked steps (``steps``) replace the last two rules in every iteration of a loop (``made_in_steps``,
    ``step_gradients``)."""
    sized = fixed.is_parameter_sized
    allocations = [(index, key, size) for index, (kind, key, size, _) in enumerate(events)
                   if kind != FREE and sized(size)]
    found = {key for _, key, _ in allocations if key in left}
    if steps:
        return frozenset(found) | made_in_steps(events, steps) | step_gradients(events, fixed, steps)
    wanted = Counter(block_bytes(size) for size in fixed.gradient_sizes if size > 0)
    if not fixed.trains or not wanted:
        return frozenset(found)
    # Gradients the run left allocated are among what it left: of each size, what it left between the
    # parameters it built (made first) and the state its step made (made last).
    state = Counter(block_bytes(size) for size in fixed.state_sizes if size > 0)
    built = Counter(block_bytes(size) for size in fixed.built_sizes if size > 0)
    gradient_indices: list[int] = []
    left_by_block: dict[int, list[int]] = {}
    for index, key, size in allocations:
        if key in left:
            left_by_block.setdefault(block_bytes(size), []).append(index)
    for block, indices in left_by_block.items():
        gradients = indices[built[block]:len(indices) - state[block]]
        taken = gradients[-wanted[block]:] if wanted[block] > 0 else []
        wanted[block] -= len(taken)
        gradient_indices += taken
    freed_at = {key: index for index, (kind, key, _, _) in enumerate(events) if kind == FREE}
    for index, key, size in sorted(allocations, key=lambda a: (freed_at.get(a[1], len(events)), a[0]), reverse=True):
        block = block_bytes(size)
        if key not in found and wanted[block] > 0:
            found.add(key)
            wanted[block] -= 1
            gradient_indices.append(index)
    if gradient_indices:  # where the step begins: the third rule
        last_gradient = max(gradient_indices)
        gradients_live_until = min(freed_at.get(events[index][1], len(events)) for index in gradient_indices)
        backward_frees = [freed_at[key] for index, key, _ in allocations if index < last_gradient
                          and key not in found and freed_at.get(key, len(events)) < gradients_live_until]
        step_begins = next((index for index, key, _ in allocations if index > last_gradient and key in left),
                           max(backward_frees, default=last_gradient))
        found.update(key for index, key, _ in allocations if index >= step_begins and index > last_gradient)
    return frozenset(found)


EventLine = tuple[EventKind, int, int, float, float, float]
"""One event on its own line, ``(kind, key, stream, fixed_bytes, bytes_per_sample, exponent)``: its request
at batch ``b`` is ``fixed_bytes + bytes_per_sample * b ** exponent`` (the exponent 1 but where two runs show
faster growth: ``fitting.law_through``)."""


def events_at(lines: Sequence[EventLine], batch: float) -> list[Event]:
    """The events at ``batch`` (a fraction of a sample too: a margin is taken on the per-sample part):
    each request on its line, rounded up to whole bytes, never below zero (the allocator rounds it
    further)."""
    events: list[Event] = []
    append = events.append  # a search builds a few thousand of these lists: the loop is kept lean
    for kind, key, stream, fixed, per_sample, exponent in lines:
        if kind == FREE:
            append((kind, key, 0, stream))
        else:
            size = math.ceil(fixed + per_sample * (batch if exponent == 1.0 else batch ** exponent))
            append((kind, key, size if size > 0 else 0, stream))
    return events


def allocated_limit(lines: Sequence[EventLine], held: Mapping[int, int], cap_bytes: int) -> float:
    """A batch above which the requests on ``lines`` hold more than ``cap_bytes`` at once, with the blocks
    ``held`` (bytes by key) allocated until a line frees them (``math.inf``: none). A bound in one pass (each
    request bounds the batch by a division), which rounding and refusals only lower."""
    live: dict[int, tuple[float, float]] = {key: (float(size), 0.0) for key, size in held.items()}
    fixed_now, per_sample_now = float(sum(held.values())), 0.0
    limit = math.inf
    room = float(cap_bytes)
    for kind, key, _, fixed, per_sample, exponent in lines:
        if exponent != 1.0:
            fixed, per_sample = 0.0, 0.0  # faster than the batch: left out, the bound stays one
        if kind == FREE:
            gone = live.pop(key, None)
            if gone is not None:
                fixed_now -= gone[0]
                per_sample_now -= gone[1]
        elif kind == ALLOC:
            live[key] = (fixed, per_sample)
            fixed_now += fixed
            per_sample_now += per_sample
            if per_sample_now > 0:
                limit = min(limit, (room - fixed_now) / per_sample_now)
    return max(limit, 0.0)


def peak_allocated_bytes(events: Sequence[Event], held: Mapping[int, int] | None = None) -> int:
    """The most ``events`` hold allocated at once, with the blocks ``held`` (bytes by key) allocated from
    the start until an event frees them (blocks rounded as the allocator rounds them; a ``try``, which the
    run survives being refused, counts nothing)."""
    live: dict[int, int] = dict(held or {})
    now = peak = sum(live.values())
    for kind, key, size, _ in events:
        if kind == FREE:
            now -= live.pop(key, 0)
        elif kind == ALLOC:
            block = block_bytes(size)
            live[key] = block
            now += block
            if now > peak:
                peak = now
    return peak


def largest_below(fits: Callable[[int], bool], high: int, resolution: float = 0.0, at_least: int = 0) -> int:
    """The largest batch up to ``high`` that ``fits`` (0 when none does), where fitting is assumed below one
    that fits and ``high`` is a bound close above the answer: it steps down in widening steps, then bisects
    to within ``resolution`` of the batch (0: to the sample). Where the answer is below ``at_least``, any
    batch below that: it stops as soon as one at most ``at_least`` fails (or ``high`` is below it)."""
    if high <= 0 or high < at_least or fits(high):
        return max(high, 0)
    failed, step = high, max(1, high // 64)  # a bound from allocated bytes is a few percent above
    while (below := max(high - step, 0)) > 0 and not fits(below):
        failed, step = below, 2 * step
        if failed <= at_least:
            return failed - 1
    while failed - below > max(1, int(below * resolution)):
        middle = (below + failed) // 2
        if fits(middle):
            below = middle
        else:
            failed = middle
            if failed <= at_least:
                return failed - 1
    return below
