"""A day of every-cell history over the fake machine, for the history views' tests and benchmark.

Cells follow what a notebook session does: build a model (memory stays), train for a while (each step's
peak rises and falls back), evaluate, now and then an out-of-memory error, a cleanup that frees what
was kept, and plain cells that touch no GPU memory. Deterministic for a seed.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from tests.fakes import FakeAllocator, FakeMachine, FakeNvml, FakeOutOfMemoryError, GiB, MiB

from jupyter_cudamem.hardware import Hardware
from jupyter_cudamem.history import CellRecord
from jupyter_cudamem.measure import Meter

SOURCES = {
    "build": "model = Net(width={size}).cuda()",
    "train": "for batch in loader: loss = step(model, batch)  # batch={size}",
    "eval": "with torch.no_grad(): scores = evaluate(model, val_loader)",
    "oom": "logits = model(torch.randn({size}, 3, 224, 224, device='cuda'))",
    "cleanup": "del model, optimizer; torch.cuda.empty_cache()",
    "plain": "print(len(results), 'results')",
}


def cells(count: int, seed: int = 0) -> Iterator[CellRecord]:
    """``count`` records of distinct measurements, numbered 1..count as In [N]."""
    machine = FakeMachine()
    hardware = Hardware(FakeAllocator(machine), FakeNvml(machine), pid=machine.pid, pid_exists=lambda pid: True)
    meter = Meter(hardware)
    rng = random.Random(seed)
    kept = 0  # what the "model" holds between cells
    for number in range(1, count + 1):
        kind = rng.choices(list(SOURCES), weights=(2, 45, 15, 0.3, 1, 37))[0]
        size = rng.randint(1, 16)
        baseline = meter.start()
        error = None
        if kind == "build" and kept < 40 * GiB:
            machine.allocate(0, size * GiB)
            kept += size * GiB
        elif kind in ("train", "eval"):
            activations = rng.randint(64, 8 * 1024) * MiB
            machine.allocate(0, activations)
            machine.free(0, activations)
        elif kind == "oom":
            try:
                machine.allocate(0, 200 * GiB)
            except FakeOutOfMemoryError as exc:
                error = type(exc).__name__.removeprefix("Fake")
        elif kind == "cleanup" and kept:
            machine.free(0, kept)
            machine.empty_cache()
            kept = 0
        measurement = meter.stop(baseline, error=error)
        yield CellRecord(number, SOURCES[kind].format(size=size), measurement, finished_at=1.7e9 + 30.0 * number)


def repeated(count: int, distinct: int = 500, seed: int = 0) -> list[CellRecord]:
    """``count`` records cycling through ``distinct`` measurements (fast to build; numbering still 1..count)."""
    pool = list(cells(min(count, distinct), seed))
    return [
        CellRecord(number, pool[(number - 1) % len(pool)].source_head, pool[(number - 1) % len(pool)].measurement)
        for number in range(1, count + 1)
    ]
