"""The replay's fast loop (growth/replay.py) against a plain model of the same rules
(tests/growth/allocator_reference.py), on random requests that reach every rule: both pools, sizes at the
thresholds, two streams, splits and merges, blocks held from the start, refused tries, returned segments and
failures under caps from tight to none."""

import random

import pytest

from jupyter_cudamem.growth.replay import ALLOC, FREE, TRY, Event, StartSegment, replay, start_keys
from tests.growth.allocator_reference import reference_replay

pytestmark = pytest.mark.dependency_free

MiB = 1 << 20
CASES = 1_000


def _pieces(rng: random.Random, total: int) -> tuple[tuple[int, bool], ...]:
    """``total`` bytes cut at random multiples of 512 into blocks, some allocated, never two free side by side
    (the allocator would have merged them)."""
    cuts = sorted({512 * rng.randrange(1, total // 512) for _ in range(rng.randint(0, 4))})
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, total])]
    blocks: list[tuple[int, bool]] = []
    for size in sizes:
        blocks.append((size, bool(blocks and not blocks[-1][1]) or rng.random() < 0.5))
    return tuple(blocks)


def _start(rng: random.Random) -> list[StartSegment]:
    segments = []
    for i in range(rng.randint(0, 3)):
        small = rng.random() < 0.5
        total = 2 * MiB if small else rng.choice([20 * MiB, 2 * MiB * rng.randint(6, 40)])
        segments.append(StartSegment((i + 1) << 34, small, _pieces(rng, total), rng.choice([0, 0, 1])))
    return segments


def _size(rng: random.Random) -> int:
    return rng.choice([
        0, rng.randint(1, 4096), rng.randint(1, MiB), MiB + rng.randint(-1024, 1024), rng.randint(MiB, 10 * MiB),
        10 * MiB + rng.randint(-1024, 1024), 19 * MiB + rng.randint(0, MiB), rng.randint(10 * MiB, 200 * MiB),
    ])


def _events(rng: random.Random, start: list[StartSegment]) -> list[Event]:
    live = list(start_keys(start).values())
    events: list[Event] = []
    for key in range(rng.randint(1, 150)):
        roll = rng.random()
        stream = 0 if rng.random() < 0.85 else 1
        if roll < 0.35 and live:
            events.append((FREE, live.pop(rng.randrange(len(live))), 0, stream))
        elif roll < 0.38:
            events.append((FREE, 10**6 + key, 0, stream))  # a key never allocated: ignored
        elif roll < 0.48:
            events.append((TRY, key, _size(rng), stream))
        else:
            events.append((ALLOC, key, _size(rng), stream))
            live.append(key)
    return events


def test_the_replay_does_what_the_plain_model_does_on_random_requests():
    rng = random.Random(42)
    outcomes = []
    for _ in range(CASES):
        start = _start(rng)
        events = _events(rng, start)
        cap = rng.choice([1 << 40, rng.randint(20, 600) * MiB])
        expected = reference_replay(events, start, cap)
        assert replay(events, start, cap) == expected, (events, start, cap)
        outcomes.append(expected)
    # The cases reach every rule: failures, refused tries, segments returned on refusal, runs that fit.
    assert sum(not o.fits for o in outcomes) > CASES // 10
    assert sum(o.fits for o in outcomes) > CASES // 10
    assert sum(bool(o.refused_tries) for o in outcomes) > CASES // 50
    assert sum(bool(o.segment_frees) for o in outcomes) > CASES // 50
    assert sum(2 * MiB in o.segment_allocs and 20 * MiB in o.segment_allocs for o in outcomes) > CASES // 50
