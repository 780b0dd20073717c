"""Whether a batch fits under a cap, by replaying a cell's recorded requests put on lines through its
measured runs, and the largest batch that does.

Two runs at different batches mostly make the same requests in the same order, but cuDNN and cuBLAS size
their workspaces by the tensors, so a pair is kept only where its two sizes can be one tensor's (``match``).
A replay costs a pass over the run's events, so the search for the largest batch starts from the bound the
allocated bytes alone set (one pass) and replays only below it. Pure Python, no torch.
"""

from __future__ import annotations

import difflib
import functools
import math
from bisect import bisect_right
from dataclasses import dataclass
from itertools import takewhile
from typing import Callable, Collection, Mapping, NamedTuple, Sequence

from ..units import TiB
from .line import EventLine, allocated_limit, events_at, largest_below, peak_allocated_bytes
from .replay import (ALLOC, FREE, MIN_BLOCK_BYTES, SMALL_REQUEST_BYTES, Allocator, Event, RecordedRun, StartSegment,
                     allocated_blocks, given_back_at_once, raised_at, start_keys)


def match(first: Sequence[Event], batch_first: int, second: Sequence[Event],
          batch_second: int) -> list[int | None]:
    """For each event of ``second``, the index of the same request in ``first`` (``None``: no partner): the
    longest common subsequence of the event kinds, a pair kept only where its sizes can be one tensor's at
    the two batches (``_one_tensor``)."""
    ratio = batch_second / batch_first
    # Frees of blocks made before the run (the last run's values, bound again) are no request of this run:
    # one run may free hundreds where the other frees none.
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
"""The most ``difflib`` may be given to pair (the product of the two middles' lengths) and the most
comparisons a walk (``_walked_runs``) makes: a large model's runs differ by a few inserted requests, which a
walk steps over; what is left unpaired is taken as proportional to the batch, erring towards a smaller one."""

RESYNC_WINDOW = 64
"""How far ahead (in events, in both runs together) the walk looks for the two runs to agree again."""
RESYNC_EVENTS = 8
"""How many events in a row must agree for the walk to take a place as the two runs' common ground."""


def _common_runs(first: Sequence[str], second: Sequence[str], first_events: Sequence[Event] = (),
                 second_events: Sequence[Event] = (), ratio: float = 1.0) -> list[tuple[int, int, int]]:
    """Runs ``(start_in_first, start_in_second, length)`` of a common subsequence of the two lists of kinds.
    ``difflib`` costs the product of the lengths, so it sees only what lies between the common prefix and
    suffix, up to ``MAX_PAIRING_WORK``; a longer middle is walked (``_walked_runs``) where the events are given.
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
    """Common runs found by walking both runs at once, pairing events while they agree (kind, stream, and
    sizes that can be one tensor's); where they stop, the walk goes on from the nearest place within
    ``RESYNC_WINDOW`` where ``RESYNC_EVENTS`` in a row agree again, for at most ``MAX_PAIRING_WORK`` comparisons."""
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

    A batch-independent tensor keeps its bytes exactly. A batch-major one is at least half per-sample bytes,
    so it grows by between (1 + ratio) / 2 and ratio times (512 bytes of slack); sizes nearly equal but not
    equal are two tensors paired by position, whose line would say memory hardly grows. With ``powers_at``
    (the two batches), a tensor of every sample against every other too (``power_of_the_batch``).
    """
    return _batch_major(low, high, ratio) or (
        powers_at is not None and power_of_the_batch(low, *powers_at, high) is not None)


def _batch_major(low: int, high: int, ratio: float) -> bool:
    """Whether ``low`` and ``high`` bytes at batches ``ratio`` apart are one tensor of fixed size or one
    whose batch multiplies its bytes (``_one_tensor``)."""
    return low == high or (1 + ratio) / 2 * low - MIN_BLOCK_BYTES <= high <= ratio * low + MIN_BLOCK_BYTES


def power_of_the_batch(size: int, batch: int, larger_batch: int, larger_size: int) -> int | None:
    """The power of the batch (2 or 3) of which ``size`` at ``batch`` and ``larger_size`` at ``larger_batch``
    are the same whole multiple (``None``: neither): a tensor of every sample against every other (a
    contrastive loss's logits). Only exact: sizes that merely grew about that much are two tensors."""
    for power in (2, 3):
        low, high = batch ** power, larger_batch ** power
        if size % low == 0 and larger_size % high == 0 and size // low == larger_size // high > 0:
            return power
    return None


class GrowthLines(NamedTuple):
    """The larger run's events on lines (``lines``), the share of its requested bytes whose line two
    measured sizes fix, and the indices of its requests with no partner (``unpaired``): a line through
    zero is also what an exactly proportional pair gives, so the value alone cannot tell them apart."""

    lines: list[EventLine]
    share: float
    unpaired: tuple[int, ...]


def growth_lines(first: Sequence[Event], batch_first: int, second: Sequence[Event],
                 batch_second: int, batch_independent: Collection[int] = ()) -> GrowthLines:
    """The events of the run at the larger batch (the closer to the batches searched), each request on the
    line through its two sizes (see ``GrowthLines``); one with no partner (an algorithm chosen at this batch
    only) is taken as proportional to the batch, so the prediction errs towards a smaller batch, but one of
    ``batch_independent`` (an optimizer step's, which the smaller run may have skipped) keeps its size."""
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
        if index is None and key in batch_independent:
            lines.append((kind, key, stream, float(size), 0.0, 1.0))
        elif index is None:
            if size > 0:
                unpaired.append(len(lines))
            lines.append((kind, key, stream, 0.0, size / batch_second, 1.0))
        else:
            matched += size
            lines.append((kind, key, stream, *law_through(first[index][2], batch_first, size, batch_second)))
    return GrowthLines(lines, matched / total if total else 1.0, tuple(unpaired))


def _same_size_left_over(first: Sequence[Event], second: Sequence[Event],
                         partner: list[int | None]) -> list[int | None]:
    """``partner`` with the requests both runs left unpaired paired by size, where a size is left over as
    often in one run as in the other: one batch-independent tensor that a change in the number of loop
    passes (a cell that joins its chunks' results) shifted against another event."""
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
    line through them, or the power of the batch where it is one (``power_of_the_batch``), which a line is not."""
    power = None if _batch_major(size, larger_size, larger_batch / batch) else \
        power_of_the_batch(size, batch, larger_batch, larger_size)
    if power is not None:
        return 0.0, float(size // batch ** power), float(power)
    per_sample = (larger_size - size) / (larger_batch - batch)
    return larger_size - per_sample * larger_batch, per_sample, 1.0


PREDICTION_RESOLUTION = 1 / 512
"""How close a prediction settles on the largest batch: a replay per halving of the gap, and below 512
samples to the sample; above, a 0.2% error is noise beside the next run's own (another algorithm)."""

REPLAY_MARGIN = 0.02
"""How much larger than its line each request's per-sample part is taken when the replay predicts a batch:
the next run is another run (another cuDNN workspace) and a size read off a line is a block or two off."""

RUNS_IN_A_ROW = 3
"""How many runs in a row a batch must fit in the replay: the rerun that proves it and the user's next two,
because the layout a run leaves decides the next (``docs/oomfix.md``, "The runs after the fix, as they happen")."""

_CARRIED = -TiB
"""Keys of blocks a replayed run made and left, renamed for the next run: below every start key a snapshot gives."""

NEXT_RUN_SCALES = (1.0, 0.5, 0.0)
"""The shares of the margin a predicted batch's per-sample parts are replayed with, all of which must fit:
the caching allocator is not monotone in the sizes, and the line's own sizes are the next run's likeliest."""


@dataclass(frozen=True)
class Fitting:
    """Whether a batch fits, by replaying requests put on lines through measured runs (``paired_fittings``,
    ``fitting_from_one``, ``paired_with_failure``); ``largest`` the largest batch that does."""

    fits: Callable[[int], bool]
    largest_up_to: Callable[[int, int], int]  # ``largest``'s, from its arguments

    def largest(self, max_batch: int = 1 << 30, at_least: int = 0) -> int:
        """The largest batch up to ``max_batch`` that fits (``max_batch`` when even that fits: nothing grows
        with the batch; 0 when none does), by the replays below the allocated bytes' bound. Where it is below
        ``at_least``, some batch below that: the replays stop once one at most ``at_least`` fails, for a
        caller that asks only whether the largest reaches ``at_least``."""
        return self.largest_up_to(max_batch, at_least)


def paired_fittings(first: Sequence[Event], batch_first: int, second: Sequence[Event], batch_second: int,
                    start: Sequence[StartSegment], released: Collection[int] = (),
                    batch_independent: Collection[int] = ()) -> Callable[[int, float], Fitting] | None:
    """Whether a batch fits under any cap and margin, ``(cap_bytes, margin)``, from two runs' events: paired
    once (a search asks at several margins, a plan at several caps), each call costs only its replays.
    ``None`` where no request pairs (a different program ran) or a run made none. Unpaired requests must
    fit either way (``_fits_either_way``), but those ``batch_independent`` lists (keys of the larger run, as
    ``fitting_from_one`` takes them), which keep their size; ``released``: as in ``next_run``."""
    if batch_first == batch_second or min(batch_first, batch_second) <= 0:
        return None
    if not any(kind != FREE for kind, *_ in first) or not any(kind != FREE for kind, *_ in second):
        return None  # a run that allocated nothing was not recorded where the allocations were made
    lines, share, unpaired = growth_lines(first, batch_first, second, batch_second, batch_independent)
    if share == 0.0:
        return None
    # Only requests with no partner: an exactly proportional pair is a batch's, not to be held fixed.
    measured = max(batch_first, batch_second)
    return lambda cap_bytes, margin: Fitting(*_fits_either_way(lines, unpaired, measured, start, cap_bytes, margin,
                                                               released))


def fitting_from_one(events: Sequence[Event], batch: int, start: Sequence[StartSegment], cap_bytes: int,
                     batch_independent: Collection[int] = (),
                     margin: float = 0.0, released: Collection[int] = ()) -> Fitting | None:
    """The same from one run: every request proportional to the batch (erring small, as
    ``growth.through_origin`` does), but the keys ``batch_independent`` lists (a fine-tune's parameters and
    optimizer state: ``growth.line``), which keep their size; a temporary must fit either way."""
    if batch <= 0 or not any(kind != FREE for kind, *_ in events):
        return None
    fixed = set(batch_independent)
    temporaries = [i for i in given_back_at_once(events) if events[i][1] not in fixed]
    return Fitting(*_fits_either_way(_proportional(events, batch, fixed), temporaries, batch, start, cap_bytes,
                                     margin, released))


def _proportional(events: Sequence[Event], batch: int, fixed: Collection[int]) -> list[EventLine]:
    """Each request of one run at ``batch`` on the line through zero, but those of ``fixed`` keys, kept flat."""
    return [(kind, key, stream, float(size), 0.0, 1.0) if kind != FREE and key in fixed
            else (kind, key, stream, 0.0, 0.0 if kind == FREE else size / batch, 1.0)
            for kind, key, size, stream in events]


def paired_with_failure(events: Sequence[Event], batch: int, failed: Sequence[Event], failed_batch: int,
                        start: Sequence[StartSegment], batch_independent: Collection[int] = (),
                        released: Collection[int] = ()) -> Callable[[int, float], Fitting] | None:
    """As ``paired_fittings``, from one run that fitted and a larger one's events up to the request that
    raised: what both made is on the line through its two sizes, the rest as from one (``fitting_from_one``).
    Why: a failed try's requests tell which are of fixed size (a mask, a workspace), which one run scales.
    A request after the failure of the size of one that grew faster than the batch is taken as its kin."""
    if batch <= 0 or failed_batch <= batch or not any(kind != FREE for kind, *_ in events):
        return None
    # Up to the request that raised (what the run gave back while the error unwound pairs with nothing).
    raised = raised_at(failed)
    failed = list(failed[:0 if raised is None else raised + 1])
    prefix = list(events[:len(failed)])
    partner = match(prefix, batch, failed, failed_batch)
    paired = {index: failed[i][2] for i, index in enumerate(partner) if index is not None}
    if not paired:
        return None
    fixed = set(batch_independent)
    laws = {index: law_through(events[index][2], batch, size, failed_batch) for index, size in paired.items()}
    faster: dict[int, tuple[float, float, float]] = {}
    for index, law in laws.items():
        size = events[index][2]
        if law[2] > 1.0 and law[2] > faster.get(size, (0.0, 0.0, 0.0))[2]:
            faster[size] = law
    lines = _proportional(events, batch, fixed)
    for index, (kind, key, size, stream) in enumerate(events):
        if index in laws:
            lines[index] = (kind, key, stream, *laws[index])
        elif kind != FREE and key not in fixed and size in faster:
            lines[index] = (kind, key, stream, *faster[size])
    temporaries = [i for i in given_back_at_once(events) if events[i][1] not in fixed and i not in paired]
    return lambda cap_bytes, margin: Fitting(*_fits_either_way(lines, temporaries, batch, start, cap_bytes, margin,
                                                               released))


def _fits_either_way(lines: Sequence[EventLine], unknown: Sequence[int], measured_batch: int,
                     start: Sequence[StartSegment], cap_bytes: int, margin: float,
                     released: Collection[int] = ()) -> tuple[Callable[[int], bool], Callable[[int, int], int]]:
    """Whether a batch fits both when the ``unknown`` requests grow as their lines say and when they keep
    their size at ``measured_batch``, at each scale of the margin (``NEXT_RUN_SCALES``); with the largest
    batch up to a bound that does. Why both: a request whose growth the runs do not tell is a batch's or a
    library's, and a larger block is no bound in the allocator (cached, it serves later requests)."""
    kept = list(lines)
    for index in unknown:
        kind, key, stream, fixed, per_sample, exponent = lines[index]
        kept[index] = (kind, key, stream, fixed + per_sample * measured_batch ** exponent, 0.0, 1.0)

    held = held_at_start(start)
    variants = [lines, kept] if unknown else [lines]

    def could_fit(batch: int) -> bool:  # reserved bytes are never below allocated ones
        return all(peak_allocated_bytes(events_at(v, batch * (1 + margin)), held) <= cap_bytes for v in variants)

    def fits_at(batch: int, scales: Sequence[float], runs: int = RUNS_IN_A_ROW) -> bool:
        return all(fits_in_a_row(events_at(v, batch * scale), start, cap_bytes, runs, held, released)
                   for scale in scales for v in variants)

    scales = tuple(dict.fromkeys(1 + margin * share for share in NEXT_RUN_SCALES))
    settling = 1 + margin  # the largest sizes: the replays settle on them first (``largest``)
    checked_after = tuple(scale for scale in scales if scale != settling)

    def fits(batch: int) -> bool:
        # The next runs (for the layout a run leaves) at the largest sizes alone; the margins are for jitter.
        return fits_at(batch, (settling,)) and fits_at(batch, checked_after, runs=1)

    @functools.cache  # a search asks again with another ``at_least`` (each of halving's batches)
    def bound(max_batch: int) -> int:
        limit = min(allocated_limit(v, held, cap_bytes) / (1 + margin) for v in variants)
        return largest_below(could_fit, max(0, min(max_batch, math.floor(limit))) if limit < math.inf else max_batch)

    def largest(max_batch: int, at_least: int) -> int:
        # One run at the largest sizes, then the runs after it, then the smaller sizes: the same answer where
        # the allocator is monotone, in a third of the replays. Each pass stops below ``at_least``.
        found = largest_below(lambda batch: fits_at(batch, (settling,), runs=1), bound(max_batch),
                              PREDICTION_RESOLUTION, at_least)
        found = largest_below(lambda batch: fits_at(batch, (settling,)), found, PREDICTION_RESOLUTION, at_least)
        while found >= at_least and found > 0 and not fits_at(found, checked_after, runs=1):
            found = largest_below(fits, found - 1, PREDICTION_RESOLUTION, at_least)
        return found

    return fits, largest


def fits_in_a_row(events: Sequence[Event], start: Sequence[StartSegment], cap_bytes: int,
                  runs: int = RUNS_IN_A_ROW, held: Mapping[int, int] | None = None,
                  released: Collection[int] = ()) -> bool:
    """Whether ``events`` fit ``runs`` times in a row under ``cap_bytes``: the first from ``start``, the
    second from where the first left the allocator with its cache emptied, each after from where the last
    left it, as the cell's next run makes them (``next_run``). ``held``: ``held_at_start(start)``, if known."""
    allocator = Allocator(start)
    try:
        # The last run's end is read by nothing: it stops at its last request (a free cannot fail).
        if allocator.play(events if runs > 1 else _up_to_last_request(events), cap_bytes)[0] is not None:
            return False
        again = next_run(events, held_at_start(start) if held is None else held, released) if runs > 1 else []
        for run in range(1, runs):
            # What the run made keeps its key, moved below the start's.
            allocator.carry(_CARRIED, empty_cache=run == 1)
            if allocator.play(again if run < runs - 1 else _up_to_last_request(again), cap_bytes)[0] is not None:
                return False
        return True
    finally:
        allocator.close()


def _up_to_last_request(events: Sequence[Event]) -> Sequence[Event]:
    """``events`` without the frees after the last request: they cannot make a run fail."""
    end = len(events)
    while end and events[end - 1][0] == FREE:
        end -= 1
    return events[:end]


def keeps_fitting(run: RecordedRun, cap_bytes: int) -> bool:
    """Whether a whole recorded run, replayed from its own start as it began, fits ``RUNS_IN_A_ROW`` times."""
    return run.whole and fits_in_a_row(run.events_from(run.start, run.remade, run.released), run.start, cap_bytes,
                                       released=run.released_keys)


def next_run(events: Sequence[Event], held: Mapping[int, int], released: Collection[int] = ()) -> list[Event]:
    """``events`` as the cell's next run makes them, from where they leave the allocator (``held``: the
    start's blocks, bytes by key). What the run made and left (a first step's optimizer state) stays and is
    not made again; a start block the run frees is, next time, the block made in its place (``_made_in_place``).
    ``released``: start blocks freed as the first step began (``replay.with_released``), which the next run
    holds through."""
    if released:
        events = [event for event in events if not (event[0] == FREE and event[1] in released)]
    freed = {key for kind, key, _, _ in events if kind == FREE}
    left = {key for kind, key, _, _ in events if kind == ALLOC and key not in freed}
    # A start that holds nothing (most runs of a search) has no block to be made in place of.
    partner = _made_in_place(events, held, _block_sizes(events, left)) if held else {}
    stays = left - set(partner.values())
    if not partner:
        return [event for event in events if not (event[0] == ALLOC and event[1] in stays)]
    again: list[Event] = []
    for event in events:
        kind, key, _, stream = event
        if kind == FREE and key in partner:
            replaced = partner[key]
            if replaced is not None:
                again.append((FREE, _CARRIED - replaced, 0, stream))
        elif not (kind == ALLOC and key in stays):
            again.append(event)
    return again


def _block_sizes(events: Sequence[Event], keys: Collection[int]) -> dict[int, int]:
    """The block bytes of each of ``keys`` that ``events`` allocate, by key."""
    # ``block_bytes``, inline: a search plays the next run of thousands of tries
    return {key: max(-(-size // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES, MIN_BLOCK_BYTES)
            for kind, key, size, _ in events if kind == ALLOC and key in keys}


def _made_before_each_free(events: Sequence[Event]) -> dict[int, int]:
    """For each key freed, the key of the last block made before its free: a name's new value is made
    before the old one goes."""
    made_before: dict[int, int] = {}
    last_made: int | None = None
    for kind, key, _, _ in events:
        if kind == ALLOC:
            last_made = key
        elif kind == FREE and last_made is not None and last_made != key:
            made_before.setdefault(key, last_made)
    return made_before


def _made_in_place(events: Sequence[Event], held: Mapping[int, int], left: Mapping[int, int]) -> dict[int, int | None]:
    """For each start block ``events`` free (``held``: bytes by key), the block of ``left`` (bytes by key)
    made in its place (``None``: none): the one made right before its free (``replay.held_elsewhere``), else
    the last left of its size (a loop's last gradients), else the one a loop left in its last iteration,
    else the first unclaimed of its pool."""
    unclaimed: dict[int, list[int]] = {}
    for key, size in left.items():
        unclaimed.setdefault(size, []).append(key)
    sizes = sorted(unclaimed)
    made_before: dict[int, int] | None = None  # read where no block of its size is left: made on first need
    partner: dict[int, int | None] = {}
    for previous, (kind, key, _, _) in zip([None, *events], events):
        if kind != FREE or key not in held or key in partner:
            continue
        made = previous[1] if previous is not None and previous[0] == ALLOC else None
        if made is None or made not in unclaimed.get(left.get(made, -1), ()):
            made = _of_its_size(held[key], sizes, unclaimed)
        if made is None:  # a value a loop binds again, from a start at another batch
            made_before = _made_before_each_free(events) if made_before is None else made_before
            made = _last_of_chain(key, made_before, left, unclaimed)
        partner[key] = made
        if made is not None:
            unclaimed[left[made]].remove(made)
    # The rest in order, each of its pool: a block whose size the line changed (a first step's state on a
    # line) is the one made in its place as often as not, and holding both would count it twice; a block of
    # the other pool is another value (a library's workspace the run made, which the next run keeps).
    missing = [key for key, made in partner.items() if made is None]
    if missing:  # most runs of a search have none: the leftovers are not sorted for nothing
        rest = {small: iter(sorted(key for size, keys in unclaimed.items() if (size <= SMALL_REQUEST_BYTES) == small
                                   for key in keys)) for small in (False, True)}
        partner.update({key: next(rest[held[key] <= SMALL_REQUEST_BYTES], None) for key in missing})
    return partner


def _of_its_size(block: int, sizes: Sequence[int], unclaimed: Mapping[int, list[int]]) -> int | None:
    """The last made of the unclaimed blocks (keys by bytes, ``sizes`` sorted) of ``block``'s size, or up to
    1 MiB smaller: the start's block may hold what its request left unsplit (``replay.same_block``)."""
    near = takewhile(lambda size: block - size <= SMALL_REQUEST_BYTES, reversed(sizes[:bisect_right(sizes, block)]))
    return next((unclaimed[size][-1] for size in near if unclaimed[size]), None)


def _last_of_chain(key: int, made_before: Mapping[int, int], left: Mapping[int, int],
                   unclaimed: Mapping[int, list[int]]) -> int | None:
    """The block made before ``key``'s free, the one made before that one's free, and so on, to one ``left``
    (bytes by key), where no other start block claimed it (``unclaimed``: keys by bytes)."""
    made = made_before.get(key)
    while made is not None and made not in left:
        made = made_before.get(made)
    return made if made is not None and made in unclaimed.get(left[made], ()) else None


def held_at_start(start: Sequence[StartSegment]) -> dict[int, int]:
    """The bytes of each block allocated in ``start``, by the key a run's events free it with
    (``replay.start_keys``): a value the cell binds again is freed in the run (``replay.held_elsewhere``)."""
    keys = start_keys(start)
    return {keys[address]: size for address, size in allocated_blocks(start).items()}


