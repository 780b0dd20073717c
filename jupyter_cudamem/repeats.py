"""Across runs: a cell that leaves memory allocated again each time it is run is growing.

Pure: reads the measurements of earlier records of the same cell (same source, ``source_key``) and
knows nothing of IPython. The first run of a cell may leave memory for good reasons (a model built,
an optimizer's first step); a second run that leaves as much again did not build anything new, so
from the second run on, a streak of runs that each left at least ``GROWTH_MIN_BYTES`` is reported
with what each run left.
"""

from __future__ import annotations

import hashlib
import statistics
from functools import lru_cache
from collections.abc import Reversible
from dataclasses import dataclass
from typing import Protocol

from .measure import Measurement
from .units import MiB, format_bytes

# Why 1 MiB: PyTorch hands out memory in blocks of 512 bytes and segments of 2 MiB, and a cell that
# keeps a scalar loss leaves a few hundred bytes; under 1 MiB a run would need thousands of repeats to
# matter. It is also the every-cell mode's default threshold for printing a line at all.
GROWTH_MIN_BYTES = MiB


class _Record(Protocol):
    @property
    def source_key(self) -> str: ...

    @property
    def measurement(self) -> Measurement: ...


@dataclass(frozen=True)
class RunGrowth:
    """A growing cell: ``runs`` runs in a row (this one included) each left memory allocated.

    ``per_run_bytes`` is the median of what they left, ``left_bytes`` what each left, oldest first.
    """

    runs: int
    per_run_bytes: int
    left_bytes: tuple[int, ...]

    @property
    def total_bytes(self) -> int:
        return sum(self.left_bytes)

    def describe(self) -> str:
        each = ", ".join(format_bytes(left, signed=True) for left in self.left_bytes[-5:])
        return (
            f"growing: each run of this cell leaves about {format_bytes(self.per_run_bytes, signed=True)} more "
            f"allocated ({self.runs} runs: {each})"
        )


@lru_cache(maxsize=256)  # the same cell run again is hashed once
def source_key(source: str) -> str:
    """The same cell run again: its source, ignoring trailing whitespace on lines and at the end."""
    text = "\n".join(line.rstrip() for line in source.strip().splitlines())
    return hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def left_allocated_bytes(measurement: Measurement) -> int:
    """What a run left allocated, over every device it touched."""
    return sum(device.allocated_delta_bytes or 0 for device in measurement.devices)


def run_growth(earlier: Reversible[_Record], key: str, measurement: Measurement) -> RunGrowth | None:
    """Whether the run measured by ``measurement`` of the cell ``key`` is growing, given the records
    before it (oldest first); ``None`` unless this run and at least the one before it each left
    ``GROWTH_MIN_BYTES`` or more."""
    now = left_allocated_bytes(measurement)
    if now < GROWTH_MIN_BYTES or not key:
        return None
    streak = [now]
    for record in reversed(earlier):
        if record.source_key != key:
            continue
        left = left_allocated_bytes(record.measurement)
        if left < GROWTH_MIN_BYTES:
            break
        streak.append(left)
    if len(streak) < 2:
        return None
    streak.reverse()
    return RunGrowth(runs=len(streak), per_run_bytes=int(statistics.median(streak)), left_bytes=tuple(streak))
