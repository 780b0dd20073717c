"""Whether a batch fits under a cap, by replaying a cell's recorded requests put on lines through its
measured runs (``pairing``), and the largest batch that does.

Why: the largest batch that fits is where the allocator's replay (``replay``) of the requests at that
batch stops failing; a replay costs a pass over the run's events, so the search for it starts from the
bound the allocated bytes alone set (one pass) and replays only below it.

Pure Python, no torch.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass
from itertools import takewhile
from typing import Callable, Collection, Mapping, Sequence

from ..units import TiB
from .pairing import EventLine, events_at, growth_lines, law_through, match
from .replay import (ALLOC, FREE, MIN_BLOCK_BYTES, SMALL_REQUEST_BYTES, Allocator, Event, StartSegment, allocated_blocks, block_bytes,
                     given_back_at_once, start_keys)

PREDICTION_RESOLUTION = 1 / 512
"""How close a prediction settles on the largest batch: a replay per halving of the gap, and below 512
samples to the sample; above, a 0.2% error is noise beside the next run's own (another algorithm)."""


REPLAY_MARGIN = 0.02
"""How much larger than its line each request's per-sample part is taken when the replay predicts a
batch: the replay is exact for the runs it was given, but the next run is another run (another cuDNN
workspace) and a size read off a line is a block or two off; 2% is a few times either. Taken on the
sizes, not off the batch found, because what jitters is the sizes."""


RUNS_IN_A_ROW = 3
"""How many runs in a row a batch must fit in the replay: the rerun that proves it and the user's next two,
as ``benchmarks/oomfix.py``'s oracle runs the cell. Why: the layout a run leaves decides the next, and a run
at the found batch leaves another than the smaller try before it (BERT-base at 33 fitted after a try at 24,
and failed on the next run but one). The user's first run starts where the cleanup after the last rerun
leaves the allocator (its cache emptied: only segments holding a block stay), each later one where the
last run left it."""

_CARRIED = -TiB
"""Keys (not sizes) of blocks a replayed run made and left, renamed for the next run (``_carried_key``): below
every start key a snapshot could give."""


NEXT_RUN_SCALES = (1.0, 0.5, 0.0)
"""The shares of the margin a predicted batch's per-sample parts are replayed with: it fits only where it
fits at each, because the caching allocator is not monotone in the sizes (a block a little larger is
cached and reused; one past 10 MiB gets a segment of its own), and the line's own sizes (no margin) are
the likeliest of the next run."""


@dataclass(frozen=True)
class Fitting:
    """Whether a batch fits, by replaying requests put on lines through measured runs (``paired_fittings``,
    ``fitting_from_one``, ``paired_with_failure``); ``largest`` the largest batch that does."""

    fits: Callable[[int], bool]
    largest_up_to: Callable[[int], int]

    def largest(self, max_batch: int = 1 << 30) -> int:
        """The largest batch up to ``max_batch`` that fits (``max_batch`` when even that fits: nothing grows
        with the batch; 0 when none does). Fitting is assumed at every batch below one that fits.

        The allocated bytes alone give a bound first (no replay), which is often the answer; below it
        the replay steps down (``largest_below``), so it runs a handful of times, not twice the
        batch's bits."""
        return self.largest_up_to(max_batch)


def paired_fittings(first: Sequence[Event], batch_first: int, second: Sequence[Event], batch_second: int,
                    start: Sequence[StartSegment], released: Collection[int] = ()
                    ) -> Callable[[int, float], Fitting] | None:
    """Whether a batch fits under any cap and margin, ``(cap_bytes, margin)``, from two runs' events: paired
    once (a search asks at several margins, a plan at several caps), each call costs only its replays.

    ``None`` when the two runs do not align: not one request of the larger run can be paired with one
    of the smaller (a different program ran; no measured line exists), or one of them made none.
    Requests left unpaired where others pair must fit both as proportional to the batch and at their
    measured size (``_fits_either_way``). ``margin``: a batch fits when its requests' per-sample parts
    ``1 + margin`` times as large do (the next run is another run: another cuDNN algorithm, a block of
    rounding). ``released``: as in ``next_run``."""
    if batch_first == batch_second or min(batch_first, batch_second) <= 0:
        return None
    if not any(kind != FREE for kind, *_ in first) or not any(kind != FREE for kind, *_ in second):
        return None  # a run that allocated nothing was not recorded where the allocations were made
    lines, share, unpaired = growth_lines(first, batch_first, second, batch_second)
    if share == 0.0:
        return None
    # Only the requests with no partner: an exactly proportional pair's line also runs through zero, and
    # keeping it at its measured size would hold a batch's activations fixed.
    measured = max(batch_first, batch_second)
    return lambda cap_bytes, margin: Fitting(*_fits_either_way(lines, unpaired, measured, start, cap_bytes, margin,
                                                               released))


def fitting_from_one(events: Sequence[Event], batch: int, start: Sequence[StartSegment], cap_bytes: int,
                     batch_independent: Collection[int] = (),
                     margin: float = 0.0, released: Collection[int] = ()) -> Fitting | None:
    """The same from one run: every request taken as proportional to the batch, but those whose keys
    ``batch_independent`` lists (the optimizer's state, a model's parameters: ``growth.fixed``), which
    keep their size; a temporary (freed before the next request) must fit both ways.

    A request is a fixed part plus a per-sample part, neither negative, so scaling all of it with the
    batch overstates every request above ``batch``: the replay then errs towards a smaller batch in
    bytes, as the line through the origin and one measured peak does (``growth.through_origin``). Where
    the parameters, their gradients and AdamW's state are most of a run (a fine-tune whose largest batch
    is a few dozen), scaling them too would put the largest batch at 0 or 1."""
    if batch <= 0 or not any(kind != FREE for kind, *_ in events):
        return None
    fixed = set(batch_independent)
    lines: list[EventLine] = [(kind, key, stream, float(size), 0.0, 1.0) if kind != FREE and key in fixed
                         else (kind, key, stream, 0.0, 0.0 if kind == FREE else size / batch, 1.0)
                         for kind, key, size, stream in events]
    temporaries = [i for i in given_back_at_once(events) if events[i][1] not in fixed]
    return Fitting(*_fits_either_way(lines, temporaries, batch, start, cap_bytes, margin, released))


def paired_with_failure(events: Sequence[Event], batch: int, failed: Sequence[Event], failed_batch: int,
                        start: Sequence[StartSegment], batch_independent: Collection[int] = (),
                        released: Collection[int] = ()) -> Callable[[int, float], Fitting] | None:
    """Whether a batch fits under any cap and margin, ``(cap_bytes, margin)``, from one run that fitted and
    the beginning of one at a larger batch that failed (its events up to the request that raised): the
    requests both made are on the line through their two sizes, as from two runs (``paired_fittings``), and those
    after the failure as from one (``fitting_from_one``). Paired once; each call costs only its replays.

    Why: one run cannot tell a request's batch-independent part from its per-sample part; a tensor of
    fixed size (a mask, a position table, a library's workspace) is scaled with the batch, and a replay
    of larger blocks is not a bound in the allocator, where they land in other segments and leave other
    fragments. A failed try's own requests say which those are.

    A request that grew with the square or cube of the batch (``pairing.law_through``) is on that power,
    and a request after the failure of the size such a one had in the fitted run is taken as its kin (a
    softmax of the logits, their gradient), which one run would scale with the batch alone."""
    if batch <= 0 or failed_batch <= batch or not any(kind != FREE for kind, *_ in events):
        return None
    # Up to the request that raised (what the run gave back while the error unwound pairs with nothing).
    failed = list(failed[:max((i for i, event in enumerate(failed) if event[0] == ALLOC), default=-1) + 1])
    prefix = list(events[:len(failed)])
    partner = match(prefix, batch, failed, failed_batch)
    paired = {index: failed[i][2] for i, index in enumerate(partner) if index is not None}
    if not paired:
        return None
    fixed = set(batch_independent)
    laws = {index: law_through(events[index][2], batch, size, failed_batch) for index, size in paired.items()}
    # A request made after the failure, of the size one that grew faster than the batch had in the run
    # that fitted, is taken as that tensor's kin (a softmax of the logits, their gradient): one run would
    # scale it with the batch alone.
    faster: dict[int, tuple[float, float, float]] = {}
    for index, law in laws.items():
        size = events[index][2]
        if law[2] > 1.0 and law[2] > faster.get(size, (0.0, 0.0, 0.0))[2]:
            faster[size] = law
    lines: list[EventLine] = []
    for index, (kind, key, size, stream) in enumerate(events):
        if kind == FREE:
            lines.append((kind, key, stream, 0.0, 0.0, 1.0))
        elif index in laws:
            lines.append((kind, key, stream, *laws[index]))
        elif key in fixed:
            lines.append((kind, key, stream, float(size), 0.0, 1.0))
        elif size in faster:
            lines.append((kind, key, stream, *faster[size]))
        else:
            lines.append((kind, key, stream, 0.0, size / batch, 1.0))
    temporaries = [i for i in given_back_at_once(events) if events[i][1] not in fixed and i not in paired]
    return lambda cap_bytes, margin: Fitting(*_fits_either_way(lines, temporaries, batch, start, cap_bytes, margin,
                                                               released))


def _fits_either_way(lines: Sequence[EventLine], unknown: Sequence[int], measured_batch: int,
                     start: Sequence[StartSegment], cap_bytes: int, margin: float,
                     released: Collection[int] = ()) -> tuple[Callable[[int], bool], Callable[[int], int]]:
    """Whether a batch fits both when the ``unknown`` requests grow with the batch as their lines say and
    when they keep the size measured at ``measured_batch`` (margins as in ``paired_fittings``).

    Why both: a request whose growth two runs do not tell (one run, or two sizes that cannot be one
    tensor's: a workspace another algorithm sized) is either a batch's or a library's. Scaling it errs
    towards a smaller batch in bytes, but not always in the allocator: a larger block freed early is
    cached and serves later requests, so a run can fit with the larger block and fail with the real one.
    The batch must fit either way, with its per-sample parts as their lines say and ``1 + margin / 2`` and
    ``1 + margin`` times as large (``NEXT_RUN_SCALES``). Returned with the largest batch up to a bound that
    fits so: found below the bound the allocated bytes alone set (a run whose allocated bytes pass the cap
    fails whatever the allocator does), then by replays."""
    kept = list(lines)
    for index in unknown:
        kind, key, stream, fixed, per_sample, exponent = lines[index]
        kept[index] = (kind, key, stream, fixed + per_sample * measured_batch ** exponent, 0.0, 1.0)

    held = held_at_start(start)
    variants = [lines, kept] if unknown else [lines]

    def could_fit(batch: int) -> bool:
        # Reserved bytes are never below allocated ones: a run whose allocated bytes alone pass the cap
        # fails whatever the allocator does.
        return all(peak_allocated_bytes(events_at(v, batch * (1 + margin)), held) <= cap_bytes for v in variants)

    def fits_at(batch: int, scales: Sequence[float], runs: int = RUNS_IN_A_ROW) -> bool:
        return all(fits_in_a_row(events_at(v, batch * scale), start, cap_bytes, runs, held, released)
                   for scale in scales for v in variants)

    scales = tuple(dict.fromkeys(1 + margin * share for share in NEXT_RUN_SCALES))
    settling = 1 + margin  # the largest sizes: the replays settle on them first (``largest``)
    checked_after = tuple(scale for scale in scales if scale != settling)

    def fits(batch: int) -> bool:
        # The runs after the first at the largest sizes alone: the margins are for a size's jitter, where
        # the allocator is not monotone; the next runs, for the layout a run leaves (one replay each scale).
        return fits_at(batch, (settling,)) and fits_at(batch, checked_after, runs=1)

    def largest(max_batch: int) -> int:
        limit = min(allocated_limit(v, held, cap_bytes) / (1 + margin) for v in variants)
        bound = largest_below(could_fit, max(0, min(max_batch, math.floor(limit))) if limit < math.inf else max_batch)
        # The replays settle on one run at the larger sizes alone, then on the runs after it, then check the
        # batch found at the smaller sizes: the same answer where the allocator is monotone and the runs
        # leave it alike, in a third of the replays.
        found = largest_below(lambda batch: fits_at(batch, (settling,), runs=1), bound, PREDICTION_RESOLUTION)
        found = largest_below(lambda batch: fits_at(batch, (settling,)), found, PREDICTION_RESOLUTION)
        while found > 0 and not fits_at(found, checked_after, runs=1):
            found = largest_below(fits, found - 1, PREDICTION_RESOLUTION)
        return found

    return fits, largest


def fits_in_a_row(events: Sequence[Event], start: Sequence[StartSegment], cap_bytes: int,
                  runs: int = RUNS_IN_A_ROW, held: Mapping[int, int] | None = None,
                  released: Collection[int] = ()) -> bool:
    """Whether ``events`` fit ``runs`` times in a row under ``cap_bytes``: the first from ``start``, the
    second from where the first left the allocator with its cache emptied, each after from where the last
    left it (``RUNS_IN_A_ROW``), as the cell's next run makes them (``next_run``).
    ``held``: ``held_at_start(start)``, where the caller has it already (a search asks thousands of times);
    ``released``: as in ``next_run``."""
    allocator = Allocator(start)
    try:
        if allocator.play(events, cap_bytes)[0] is not None:
            return False
        again = next_run(events, held_at_start(start) if held is None else held, released) if runs > 1 else []
        for run in range(1, runs):
            # Played on from where the last run left the allocator: the same as replaying its ``layout``.
            allocator.carry(_carried_key, empty_cache=run == 1)
            if allocator.play(again, cap_bytes)[0] is not None:
                return False
        return True
    finally:
        allocator.close()


def _carried_key(key: int) -> int:
    """A block's key in the next run: what the run made keeps its key, moved below the start's."""
    return key if key < 0 else _CARRIED - key


def next_run(events: Sequence[Event], held: Mapping[int, int], released: Collection[int] = ()) -> list[Event]:
    """``events`` as the cell's next run makes them, from where they leave the allocator (``held``: the
    start's blocks, bytes by key). What the run made and never freed in a block the start did not free
    (a first step's optimizer state) stays, and is not made again; a start block the run frees (a value
    the cell binds again, gradients zeroed) is, next time, the block the run made in its place: the one
    made right before its free (``replay.held_elsewhere``), else one of the same size it left, else the
    first it left unclaimed.

    ``released``: keys of the start blocks the run let go as its first optimizer step began, the last
    run's state that ``%oomfix``'s put-back held until then (``replay.with_released``): the cell's next run
    holds its state through, so it does not free them, and the state the step made in their place stays
    (a step updates its state in place)."""
    events = _without_frees_of(events, released)
    freed = {key for kind, key, _, _ in events if kind == FREE}
    # ``block_bytes``, inline: a search plays the next run of thousands of tries
    left = {key: max(-(-size // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES, MIN_BLOCK_BYTES)
            for kind, key, size, _ in events if kind == ALLOC and key not in freed}
    unclaimed: dict[int, list[int]] = {}
    for key, size in left.items():
        unclaimed.setdefault(size, []).append(key)
    sizes = sorted(unclaimed)
    partner: dict[int, int | None] = {}
    for previous, (kind, key, _, _) in zip([None, *events], events):
        if kind != FREE or key not in held or key in partner:
            continue
        made = previous[1] if previous is not None and previous[0] == ALLOC else None
        if made is None or made not in unclaimed.get(left.get(made, -1), ()):
            # the start's block may hold up to 1 MiB its request left unsplit (``replay.same_block``)
            near = takewhile(lambda size: held[key] - size <= SMALL_REQUEST_BYTES,
                             reversed(sizes[:bisect_right(sizes, held[key])]))
            made = next((unclaimed[size][0] for size in near if unclaimed[size]), None)
        partner[key] = made
        if made is not None:
            unclaimed[left[made]].remove(made)
    # The rest in order: a block whose size the line changed (a first step's state on a line) is the one
    # made in its place as often as not, and holding both would count it twice.
    rest = iter(sorted(key for keys in unclaimed.values() for key in keys))
    partner.update({key: next(rest, None) for key, made in partner.items() if made is None})
    stays = set(left) - set(partner.values())
    again: list[Event] = []
    for kind, key, size, stream in events:
        if kind == FREE and key in partner:
            replaced = partner[key]
            if replaced is not None:
                again.append((FREE, _CARRIED - replaced, 0, stream))
        elif not (kind == ALLOC and key in stays):
            again.append((kind, key, size, stream))
    return again


def _without_frees_of(events: Sequence[Event], keys: Collection[int]) -> Sequence[Event]:
    """``events`` but the frees of ``keys`` (``events`` itself where there are none to leave out)."""
    if not keys:
        return events
    return [event for event in events if not (event[0] == FREE and event[1] in keys)]


def held_at_start(start: Sequence[StartSegment]) -> dict[int, int]:
    """The bytes of each block allocated in ``start``, by the key a run's events free it with
    (``replay.start_keys``): a value the cell binds again is freed in the run (``replay.held_elsewhere``)."""
    keys = start_keys(start)
    return {keys[address]: size for address, size in allocated_blocks(start).items()}


def allocated_limit(lines: Sequence[EventLine], held: Mapping[int, int], cap_bytes: int) -> float:
    """A batch above which the requests on ``lines`` hold more than ``cap_bytes`` at once, with the blocks
    ``held`` (bytes by key) allocated at the start until a line frees them (``math.inf``: none; a bound,
    not the answer: each block is at least its line's bytes, and the allocator's rounding and refusals
    only lower the real one).

    One pass: at each request the bytes held are ``fixed + per_sample * batch`` summed over what is
    live, so each request bounds the batch by a division; ``peak_allocated_bytes`` at the batches
    around it then settles it in a few passes, where bisecting on it alone takes the batch's bits."""
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


def largest_below(fits: Callable[[int], bool], high: int, resolution: float = 0.0) -> int:
    """The largest batch up to ``high`` that ``fits`` (0 when none does), where fitting is assumed at every
    batch below one that fits and ``high`` is a bound close above the answer: from ``high`` it steps down
    in widening steps to a batch that fits, then bisects between it and the last that failed, until
    they are within ``resolution`` of the batch (0: to the sample)."""
    if high <= 0 or fits(high):
        return max(high, 0)
    failed, step = high, max(1, high // 64)  # a bound from allocated bytes is a median 2% above (simulator)
    while (below := max(high - step, 0)) > 0 and not fits(below):
        failed, step = below, 2 * step
    while failed - below > max(1, int(below * resolution)):
        middle = (below + failed) // 2
        if fits(middle):
            below = middle
        else:
            failed = middle
    return below
