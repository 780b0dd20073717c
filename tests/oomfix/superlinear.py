"""A randomized world of steps whose memory grows faster than the batch, to run ``%oomfix``'s batch search
against (``tests/oomfix/test_simulator.py``, ``benchmarks/oomfix_simulated.py``).

Where every sample meets every other (a contrastive loss's batch x batch logits, their softmax and
gradient; attention across the batch) a step holds tensors of ``c x batch ** 2`` bytes beside its
batch-major ones; from a small probe they are a sliver of the peak, at the largest batch that fits most
of it. ``tests/oomfix/world.py`` draws steps whose memory is a line in the batch; this world draws the
rest of the space: a cap of 2 to 80 GiB, batch-independent memory (weights) 0 to half of it, one to three
batch x batch tensors holding 20% to 95% of the room at the largest fitting batch (log-uniform from 4 to
100,000), one to four batch-major ones, start ratios 1.05 to 100. Each run is played through the
project's model of PyTorch's caching allocator; a failed one is recorded up to the request that raised,
as PyTorch records it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from jupyter_cudamem.growth.fitting import largest_below
from jupyter_cudamem.growth.replay import Event, replay
from jupyter_cudamem.growth.replay import RecordedRun
from jupyter_cudamem.batchsearch import BatchSearch, Observation
from tests.oomfix.world import below_halving, draws, met_goal

GiB = 2**30
CAPS_GIB = (2, 4, 8, 16, 24, 40, 80)


@dataclass(frozen=True)
class Step:
    """Bytes: ``fixed`` held through the run, ``per_sample`` of each batch-major tensor, ``square`` of each
    batch x batch one (per sample squared: a whole number, the bytes of its element times its other
    dimensions)."""

    cap_bytes: int
    fixed: int
    per_sample: tuple[float, ...]
    square: tuple[int, ...]

    def events(self, batch: int) -> list[Event]:
        """The batch-major tensors, then the batch x batch ones (logits, softmax, gradient: each made
        while the last lives), all freed at the end."""
        events: list[Event] = [("alloc", 100, self.fixed, 0)] if self.fixed else []
        events += [("alloc", i, max(int(size * batch), 1), 0) for i, size in enumerate(self.per_sample)]
        events += [("alloc", 10 + j, size * batch * batch, 0) for j, size in enumerate(self.square)]
        events += [("free", 10 + j, 0, 0) for j in range(len(self.square))]
        events += [("free", i, 0, 0) for i in range(len(self.per_sample))]
        return events

    def fits(self, batch: int) -> bool:
        return replay(self.events(batch), (), self.cap_bytes).fits

    def observe(self, batch: int) -> Observation:
        events = self.events(batch)
        result = replay(events, (), self.cap_bytes)
        if result.fits:
            return Observation(True, peak_bytes=result.peak_allocated_bytes, recorded=RecordedRun((), tuple(events)))
        assert result.failed_at is not None and result.allocated_at_failure_bytes is not None
        held = result.allocated_at_failure_bytes
        return Observation(False, need_bytes=held + events[result.failed_at][2], held_bytes=held,
                           recorded=RecordedRun((), tuple(events[:result.failed_at + 1])))


def largest(fits: Callable[[int], bool]) -> int:
    """The largest batch that fits, where every smaller one does (0: none)."""
    high = 1
    while fits(high):
        high *= 2
    return largest_below(fits, high - 1)


@dataclass(frozen=True)
class Case:
    largest: int
    start: int
    found: int
    reruns: int
    halving: int

    @property
    def met_goal(self) -> bool:
        return met_goal(self.found, self.largest, self.reruns)

    @property
    def worse_than_halving(self) -> bool:
        return below_halving(self.found, self.halving, self.largest)


def draw(rng: random.Random) -> tuple[Step, int, int] | None:
    cap = rng.choice(CAPS_GIB) * GiB
    fixed = int(rng.uniform(0.0, 0.5) * cap)
    target = math.exp(rng.uniform(math.log(4), math.log(100_000)))
    room = 0.95 * cap - fixed
    square_share = rng.uniform(0.2, 0.95)
    squares = rng.randint(1, 3)
    weights = [rng.random() for _ in range(rng.randint(1, 4))]
    step = Step(cap, fixed, tuple((1 - square_share) * room / target * w / sum(weights) for w in weights),
                tuple(max(2, 2 * round(square_share * room / (squares * target * target) / 2)) for _ in range(squares)))
    found = largest(step.fits)
    if found < 1:
        return None
    start = max(int(found * math.exp(rng.uniform(math.log(1.05), math.log(100)))), found + 1)
    if step.fits(start):
        return None
    return step, start, found


def cases(count: int, seed: int) -> list[Case]:
    out: list[Case] = []
    for step, start, truth in draws(draw, count, seed):
        failed = step.observe(start)
        search = BatchSearch(start, step.cap_bytes, need_bytes=failed.need_bytes)
        while True:
            search.set_allocator((), step.cap_bytes)
            batch = search.next()
            if batch is None:
                break
            search.record(batch, step.observe(batch))
        halved = start // 2
        while halved >= 1 and not step.fits(halved):
            halved //= 2
        out.append(Case(truth, start, search.answer or 0, len(search.attempts), halved))
    return out
