"""Which requests of two runs of a cell at two batches are the same tensor, and the line each pair gives.

Why: the allocator's replay predicts a batch it has not run by putting each request on the line through
its two measured sizes (``fitting``). Two runs at different batches mostly make the same requests in
the same order, but cuDNN and cuBLAS pick algorithms (and workspaces) by the tensors' sizes, so a few
requests appear in one run only; a pair is kept only where its two sizes can be one tensor's.

Pure Python, no torch: events as ``replay`` plays them.
"""

from __future__ import annotations

import difflib
import math
from typing import NamedTuple, Sequence

from .replay import FREE, MIN_BLOCK_BYTES, Event, EventKind

def match(first: Sequence[Event], batch_first: int, second: Sequence[Event],
          batch_second: int) -> list[int | None]:
    """For each event of ``second``, the index of the same request in ``first`` (``None``: no partner).

    Two runs of a cell at different batches mostly make the same requests in the same order, but not
    always: cuDNN and cuBLAS pick algorithms (and workspaces) by the tensors' sizes, so a few requests
    appear in one run only. The longest common subsequence of the event kinds pairs the rest, and a
    pair is kept only if its sizes can be one tensor's at the two batches (``_one_tensor``).
    """
    ratio = batch_second / batch_first
    # A free of a block made before the run (the last run's values, let go as the cell binds them again)
    # is no request of this run: one run may free hundreds where the other frees none, and the two are
    # aligned without them.
    own_first, own_second = _made_in_the_run(first), _made_in_the_run(second)
    firsts, seconds = [first[i] for i in own_first], [second[i] for i in own_second]
    kinds_first, kinds_second = [e[0] for e in firsts], [e[0] for e in seconds]
    partner: list[int | None] = [None] * len(second)
    for low, high, length in _common_runs(kinds_first, kinds_second, firsts, seconds, ratio):
        for offset in range(length):
            a, b = firsts[low + offset], seconds[high + offset]
            if a[0] != FREE and a[3] == b[3] and _one_tensor(a[2], b[2], ratio, (batch_first, batch_second)):
                partner[own_second[high + offset]] = own_first[low + offset]
    return partner


def _made_in_the_run(events: Sequence[Event]) -> list[int]:
    """The indices of ``events`` but the frees of blocks the run did not allocate."""
    made: set[int] = set()
    kept = []
    for index, (kind, key, *_) in enumerate(events):
        if kind != FREE:
            made.add(key)
        elif key not in made:
            continue
        kept.append(index)
    return kept


MAX_PAIRING_WORK = 4_000_000
"""The most ``difflib`` may be given to pair (the product of the two middles' lengths; about a second
in Python). Longer middles are walked (``_walked_runs``), at most this many comparisons: runs of a large
model at two batches differ by a few inserted requests, which a walk steps over; runs whose middles
differ throughout (a loop over chunks of its data) pair little either way, and the rest is taken as
proportional to the batch, which errs towards a smaller batch."""

RESYNC_WINDOW = 64
"""How far ahead (in events, in both runs together) the walk looks for the two runs to agree again."""
RESYNC_EVENTS = 8
"""How many events in a row must agree for the walk to take a place as the two runs' common ground."""


def _common_runs(first: Sequence[str], second: Sequence[str], first_events: Sequence[Event] = (),
                 second_events: Sequence[Event] = (), ratio: float = 1.0) -> list[tuple[int, int, int]]:
    """Runs ``(start_in_first, start_in_second, length)`` of a common subsequence of the two lists of kinds.

    ``difflib`` costs the product of the lengths on a two-letter alphabet, so it only sees what lies
    between the common prefix and suffix (most runs of a cell differ in a few places, or none), and
    only up to ``MAX_PAIRING_WORK``; a longer middle is walked (``_walked_runs``) where the events
    themselves are given.
    """
    head = 0
    while head < min(len(first), len(second)) and first[head] == second[head]:
        head += 1
    tail = 0
    while tail < min(len(first), len(second)) - head and first[-1 - tail] == second[-1 - tail]:
        tail += 1
    first_middle, second_middle = first[head:len(first) - tail], second[head:len(second) - tail]
    if len(first_middle) * len(second_middle) <= MAX_PAIRING_WORK:
        matcher = difflib.SequenceMatcher(None, first_middle, second_middle, autojunk=False)
        middle = [(a, b, n) for a, b, n in matcher.get_matching_blocks()]
    elif first_events and second_events:
        middle = _walked_runs(first_events[head:len(first) - tail], second_events[head:len(second) - tail], ratio)
    else:
        middle = []
    return ([(0, 0, head)] + [(a + head, b + head, n) for a, b, n in middle]
            + [(len(first) - tail, len(second) - tail, tail)])


def _walked_runs(first: Sequence[Event], second: Sequence[Event], ratio: float) -> list[tuple[int, int, int]]:
    """Common runs found by walking both runs at once: events agree (same kind and stream, and an
    allocation's sizes can be one tensor's at the two batches) and are paired while they do; where they
    stop agreeing, the nearest place within ``RESYNC_WINDOW`` events where ``RESYNC_EVENTS`` in a row
    agree again is where the walk goes on. At most ``MAX_PAIRING_WORK`` comparisons: past that, the rest
    is left unpaired."""
    work = 0

    def agree(i: int, j: int) -> bool:
        a, b = first[i], second[j]
        return a[0] == b[0] and a[3] == b[3] and (a[0] == FREE or _one_tensor(a[2], b[2], ratio))

    def agree_from(i: int, j: int) -> bool:
        nonlocal work
        length = min(RESYNC_EVENTS, len(first) - i, len(second) - j)
        work += length
        return length > 0 and all(agree(i + k, j + k) for k in range(length))

    runs: list[tuple[int, int, int]] = []
    i = j = 0
    while i < len(first) and j < len(second) and work < MAX_PAIRING_WORK:
        start_i, start_j = i, j
        while i < len(first) and j < len(second) and agree(i, j):
            i, j = i + 1, j + 1
        work += i - start_i + 1
        if i > start_i:
            runs.append((start_i, start_j, i - start_i))
            continue
        found = next(((i + di, j + distance - di) for distance in range(1, RESYNC_WINDOW + 1)
                      for di in range(distance + 1)
                      if i + di < len(first) and j + distance - di < len(second)
                      and agree_from(i + di, j + distance - di)), None)
        if found is None:  # nothing agrees nearby: step both over this event
            i, j = i + 1, j + 1
        else:
            i, j = found
    runs.append((len(first), len(second), 0))
    return runs


def _one_tensor(low: int, high: int, ratio: float, powers_at: tuple[int, int] | None = None) -> bool:
    """Whether ``low`` and ``high`` requested bytes at two batches (``ratio`` apart) can be one tensor.

    A tensor that does not depend on the batch has the same shape, so exactly the same bytes. One that
    does is batch-major: the batch multiplies its bytes, and a fixed part (concatenated batch-independent
    data) is the smaller share; so at the smaller batch at least half its bytes are the per-sample part,
    and the sizes grow by between (1 + ratio) / 2 and ratio times (512 bytes of slack for rounding). Sizes
    nearly equal but not equal are two different tensors that the kinds' subsequence paired by position (a
    layer later, half the spatial size and twice the batch), whose line would say memory hardly grows with
    the batch.

    With ``powers_at`` (the two batches), sizes that are the same whole multiple of the square or the cube
    of their batch are one tensor too, of every sample against every other (a contrastive loss's batch x
    batch logits: its line is then a power of the batch, ``law_through``; ``power_of_the_batch``).
    """
    return _batch_major(low, high, ratio) or (powers_at is not None and power_of_the_batch(low, *powers_at, high) is not None)


def _batch_major(low: int, high: int, ratio: float) -> bool:
    """Whether ``low`` and ``high`` bytes at batches ``ratio`` apart are one tensor of fixed size or one
    whose batch multiplies its bytes (``_one_tensor``)."""
    return low == high or (1 + ratio) / 2 * low - MIN_BLOCK_BYTES <= high <= ratio * low + MIN_BLOCK_BYTES


def power_of_the_batch(size: int, batch: int, larger_batch: int, larger_size: int) -> int | None:
    """The power of the batch (2 or 3) of which ``size`` at ``batch`` and ``larger_size`` at ``larger_batch``
    are the same whole multiple (``None``: neither). A tensor of every sample against every other requests
    exactly its shape's bytes, a whole number per power of the batch, the same at both. Sizes that only
    grew about that much are two tensors the kinds' subsequence paired by position (a bottleneck's
    fourfold channels grow by about the cube of the ratio of batches twice apart)."""
    for power in (2, 3):
        low, high = batch ** power, larger_batch ** power
        if size % low == 0 and larger_size % high == 0 and size // low == larger_size // high > 0:
            return power
    return None


EventLine = tuple[EventKind, int, int, float, float, float]
"""One event on its own line, ``(kind, key, stream, fixed_bytes, bytes_per_sample, exponent)`` (the
whole cell's peak on one line is ``line.Growth``): its request at batch ``b`` is ``fixed_bytes +
bytes_per_sample * b ** exponent``. The exponent is 1 but for a request two runs show growing faster
than the batch (``fitting.paired_with_failure``)."""


class GrowthLines(NamedTuple):
    """The larger run's events on lines (``lines``), the share of its requested bytes whose line two
    measured sizes fix, and the indices of its requests with no partner (``unpaired``): a line through
    zero is also what an exactly proportional pair gives, so the value alone cannot tell them apart."""

    lines: list[EventLine]
    share: float
    unpaired: tuple[int, ...]


def growth_lines(first: Sequence[Event], batch_first: int, second: Sequence[Event],
                 batch_second: int) -> GrowthLines:
    """The events of the run at the larger batch, each request on a line (see ``GrowthLines``).

    The larger run is the template (its order of requests and frees is kept), being the closer to the
    batches searched. A request with a partner in the other run gets the line through both sizes; one
    without (an algorithm chosen at this batch only) is taken as proportional to the batch, the larger
    of the two guesses its single size allows, so the prediction errs towards a smaller batch.
    """
    if batch_first > batch_second:
        first, batch_first, second, batch_second = second, batch_second, first, batch_first
    partner = _same_size_left_over(first, second, match(first, batch_first, second, batch_second))
    lines: list[EventLine] = []
    unpaired: list[int] = []
    matched = total = 0
    for (kind, key, size, stream), index in zip(second, partner):
        if kind == FREE:
            lines.append((kind, key, stream, 0.0, 0.0, 1.0))
            continue
        total += size
        if index is None:
            if size > 0:
                unpaired.append(len(lines))
            lines.append((kind, key, stream, 0.0, size / batch_second, 1.0))
        else:
            matched += size
            lines.append((kind, key, stream, *law_through(first[index][2], batch_first, size, batch_second)))
    return GrowthLines(lines, matched / total if total else 1.0, tuple(unpaired))


def _same_size_left_over(first: Sequence[Event], second: Sequence[Event],
                         partner: list[int | None]) -> list[int | None]:
    """``partner`` with the requests both runs left unpaired paired by size, where a size is left over
    exactly as often in one run as in the other: the same batch-independent tensor, placed by the kinds'
    subsequence against another event. Why: where the number of loop passes changes with the batch (a
    cell that runs its model over chunks of its data, then joins their results), the passes shift
    every event after them, and the join, the largest request and the same at every chunk size, would
    be taken as proportional to the chunk."""
    taken = {index for index in partner if index is not None}
    left_first: dict[int, list[int]] = {}
    for index, (kind, _, size, _) in enumerate(first):
        if kind != FREE and index not in taken:
            left_first.setdefault(size, []).append(index)
    left_second: dict[int, list[int]] = {}
    for index, ((kind, _, size, _), paired) in enumerate(zip(second, partner)):
        if kind != FREE and paired is None:
            left_second.setdefault(size, []).append(index)
    paired_now = list(partner)
    for size, indices in left_second.items():
        others = left_first.get(size, [])
        if len(others) == len(indices):
            for index, other in zip(indices, others):
                if first[other][3] == second[index][3]:
                    paired_now[index] = other
    return paired_now


def law_through(size: int, batch: int, larger_size: int, larger_batch: int) -> tuple[float, float, float]:
    """``(fixed_bytes, bytes_per_sample, exponent)`` of a request through its sizes at two batches: the
    line through them, or, for a tensor of every sample against every other (``power_of_the_batch``), its
    power of the batch, exact for it (the line through its two sizes would put it above them between the
    two by up to the ratio of the batches, and below them beyond)."""
    power = None if _batch_major(size, larger_size, larger_batch / batch) else \
        power_of_the_batch(size, batch, larger_batch, larger_size)
    if power is not None:
        return 0.0, float(size // batch ** power), float(power)
    per_sample = (larger_size - size) / (larger_batch - batch)
    return larger_size - per_sample * larger_batch, per_sample, 1.0


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
