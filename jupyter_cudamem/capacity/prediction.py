"""The capacity plan: from measured runs of a cell, which cards it fits and at which batch.

For each card:

    room = card total - non-PyTorch part - fixed
    largest batch = min(floor(room x (1 - margin) / per sample),          # the allocated line
                        floor(room_reserved / per sample reserved))       # the reserved line

The margin is taken from the room above the fixed part, so it costs the same share of the batch on
every card and for every cell: the plan's batch is ``1 - margin`` of the batch the allocated line
allows, whatever the fixed part (a share of the card's total would cost a cell whose fixed part is
half the card twice the margin in batch terms).

A card limits what PyTorch's caching allocator **reserves**, not what it has allocated: blocks are
rounded up, and a free part of a segment that still holds a live block cannot be given back, so a
request can fail with less allocated than the cap. Each run is therefore measured from an empty cache
(``Runner`` releases it before the run) and a second line is fitted to the runs' reserved peaks; the
plan takes the smaller batch of the two lines. Where the allocator wastes little, the allocated line
with its margin is the smaller and decides (a convnet, a transformer); where it wastes more than the
margin (a cuDNN LSTM's large buffers leave 2 GB of a 16 GB cap unusable, ``benchmarks/plan.py``), the
reserved line decides. The reserved line needs no margin for the allocator: it measured it.

The **non-PyTorch part** is what this process holds on the GPU outside PyTorch's pools: the CUDA
context, cuDNN/cuBLAS handles and library workspaces, anything allocated by CuPy or NCCL. It is
measured on this machine (NVML's memory of this process minus what PyTorch has reserved), not
assumed, and the plan says so; another card's driver and architecture move it by some tens of MiB.

The **margin** (``DEFAULT_MARGIN``) covers what the allocated line does not see: the allocator's
rounding and the driver's 0.5-1.7% of the nominal memory (see ``cards``).

**Calibrated** (``--calibrate``, ``runs.calibrate``): the cell also runs at batches that fill the
smallest card of the plan (PyTorch capped here to play it) until the largest that fits is found, and every
card's line is the allocated line scaled by what that memory took per byte of it (``calibrated``), with
``CALIBRATED_MARGIN``; the reserved line is not needed then. Two runs cannot see what a cap changes (the cache the allocator gives back under it, the
workspaces libraries skip); the calibration measures it where it matters.

For the batch as written: it fits, or the plan gives gradient-accumulation steps by the rule ``%oomfix``'s
advice uses (``growth.accumulation``): the largest micro-batch that fits and divides the batch where one is
within half of the largest that fits, else steps of the largest that fits and a smaller last one.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..growth.accumulation import AccumulationPlan, accumulation_plan
from ..growth.fitting import REPLAY_MARGIN, paired_fittings
from ..growth.replay import optional_workspaces
from ..growth.line import Agreement, Line

if TYPE_CHECKING:
    from ..growth.replay import RecordedRun

DEFAULT_MARGIN = 0.04
"""Fraction of the room above the fixed part (the card less the non-PyTorch part less the fixed part)
that a plan leaves free, so the plan's batch is at most ``1 - margin`` of what the allocated line
allows: the allocator's rounding and the driver's share that the card table does not subtract. The
same figure as %oomfix's margin (``OomFix.margin``); ``benchmarks/plan.py`` measures whether it is
enough, card by card."""

CALIBRATED_MARGIN = 0.03
"""The margin of a calibrated plan (``--calibrate``), whose ratio already holds the allocator's rounding
and waste at this card's limit. What it still does not see: the share of another card's memory that its
driver and firmware keep, 0.5-1.7% of the nominal memory (see ``cards``), and how far the ratio moves
between the card it was measured at and another: measured up to 1.1% between a 16 GiB cap and an 80 GiB
card's limit (the LSTM of ``benchmarks/plan.py``: 1.144 and 1.134), smaller on the larger card, so the
drift is on the cautious side; the driver's share is not. Their sum, rounded up."""


@dataclass(frozen=True)
class Run:
    """One measured run of the cell. Sizes in bytes; ``None`` where it could not be read.

    ``peak_bytes`` is PyTorch's allocated peak during the run (counters reset as it started);
    ``peak_reserved_bytes`` its reserved peak (the cache emptied as it started);
    ``start_bytes`` what was allocated as it started; ``non_pytorch_bytes`` what the process held
    outside PyTorch's pools when it ended; ``oom`` whether it ran out of GPU memory; ``recorded`` the
    allocator's history of the run (``None`` where this torch or another recording did not allow it).
    """

    label: str
    batch: int | None
    peak_bytes: int | None
    start_bytes: int | None
    non_pytorch_bytes: int | None = None
    oom: bool = False
    autocast: bool = False
    peak_reserved_bytes: int | None = None
    recorded: RecordedRun | None = field(default=None, repr=False, compare=False)


def usable_bytes(total_bytes: int, non_pytorch_bytes: int, margin: float = 0.0) -> int:
    """What PyTorch may use on a card of ``total_bytes``: its total less the non-PyTorch part. ``margin``
    is kept for callers that plan a fixed-size cell (no batch to take the margin from): it is then taken
    from the whole."""
    return max(int((total_bytes - non_pytorch_bytes) * (1 - margin)), 0)


def largest_batch(line: Line, usable: float, margin: float = 0.0) -> int:
    """The largest batch whose predicted peak stays within ``usable`` bytes with ``margin`` of the room
    above the fixed part left free (0: not even one)."""
    if line.slope_bytes <= 0:
        raise ValueError("a line whose peak does not grow with the batch has no largest batch")
    room = usable - line.intercept_bytes
    if room <= 0:
        return 0
    # A hair of tolerance so a budget that is exactly k samples' worth is k, not k - 1 by rounding.
    return max(int(math.floor(room * (1 - margin) / line.slope_bytes + 1e-9)), 0)


def plan_largest(line: Line, usable: float, margin: float, reserved_line: Line | None = None) -> int:
    """The smaller largest batch of the allocated line (with ``margin``) and the reserved line, which
    measured the allocator's overhead that ``DEFAULT_MARGIN`` stands for: it keeps only what a larger
    margin asks beyond that (``--margin 0.1`` leaves 6% of the room free below it), so a margin the user
    sets moves the batch whichever line decides; see the module docstring."""
    largest = largest_batch(line, usable, margin)
    if reserved_line is not None and reserved_line.slope_bytes > 0:
        largest = min(largest, largest_batch(reserved_line, usable, max(margin - DEFAULT_MARGIN, 0.0)))
    return largest


def replayed_largest(smaller: Run, larger: Run, margin: float,
                     workspaces_optional: bool = False) -> Callable[[int], int] | None:
    """The largest batch that fits what PyTorch may use on a card (the argument, in bytes), by the
    allocator's replay of the line's two recorded runs, the model %oomfix's search plays its tries through
    (``growth.fitting``): their requests on the lines their two sizes give, replayed through the caching
    allocator under the card's cap from the segments the larger run started with, so what the allocated
    line cannot see (rounding, blocks that split segments, a cuDNN LSTM's buffers that leave part of the
    cap unusable) counts where it arises; workspaces a library frees at once count as what it may do
    without (``growth.replay.optional_workspaces``) where ``workspaces_optional`` (the cell coped with
    them refused: ``runs.probe_workspaces``), else as needed. ``margin`` is taken on the requests' per-sample
    parts (``growth.fitting.REPLAY_MARGIN`` and what a user's margin asks beyond the default).
    ``None`` where the runs were not recorded or do not pair."""
    if smaller.recorded is None or larger.recorded is None or not smaller.batch or not larger.batch:
        return None
    start = larger.recorded.start
    small, large = smaller.recorded.events_from(start), larger.recorded.events_from(start)
    if workspaces_optional:
        small, large = optional_workspaces(small), optional_workspaces(large)
    under = paired_fittings(small, smaller.batch, large, larger.batch, start)
    if under is None:
        return None
    return lambda usable: under(usable, margin).largest()


def replay_margin(margin: float) -> float:
    """The replay's margin on the requests for a plan's ``margin``: its own, plus what a user's margin asks
    beyond the default one (which stands for what the replay sees: the allocator's rounding and waste)."""
    return REPLAY_MARGIN + max(margin - DEFAULT_MARGIN, 0.0)


def autocast_largest(largest: int, line: Line, autocast_line: Line) -> int:
    """The largest batch under autocast, from the float32 column's ``largest``: the part that does not
    depend on the batch is the same (weights, gradients and optimizer state stay float32), so the room
    that fits ``largest`` float32 samples fits ``largest x float32 slope / autocast slope`` of them, with
    whatever decided the float32 column (the allocator's replay, the reserved line's waste, a calibration,
    the margin) taken per byte alike."""
    return int(largest * line.slope_bytes / autocast_line.slope_bytes + 1e-9)


def calibrated(line: Line, ratio: float) -> Line:
    """The allocated line scaled by what a card's cap really takes per byte of it (``--calibrate``).

    Uncapped, PyTorch's allocated peak is not what a card's cap must hold: under a cap the allocator
    cannot give back free parts of segments that still hold live blocks (a cuDNN LSTM: 14% more), and a
    library that sizes an optional workspace by what is free does without it (cuDNN's convolutions in
    inference: a third less). ``benchmarks/plan_calibration.py`` measured that ratio at the notebook's
    batch and found it does not carry to a card's scale for the LSTM (1.05 at batch 64, 1.13 at 32, about
    1.15 at a 16 GiB card's limit); where the cell fills a card it does, from a smaller card to a larger
    one (see ``runs.CalibrationScale``). Measured at a 16 GiB cap (1.042 convnet, 1.008 transformer,
    0.676 inference, 1.144 LSTM) with ``CALIBRATED_MARGIN``, every prediction of ``benchmarks/plan.py``
    for 16, 24 and 40 GiB was 3.0-4.6% below the real largest batch. Scaled as a whole: the ratio is
    measured at one batch, so it cannot be split between the fixed and the per-sample part."""
    return Line(line.slope_bytes * ratio, line.intercept_bytes * ratio)


@dataclass(frozen=True)
class Calibration:
    """The largest batch that fitted with ``usable_bytes`` for PyTorch (on ``card``, or this card capped
    to play it), the smallest that did not (``None``: the search stopped first)."""

    fitted: int
    failed: int | None
    usable_bytes: int
    runs: int
    stopped: str = ""  # why the search stopped before it bracketed the largest batch
    card: str = "this card"

    def ratio(self, line: Line) -> float:
        """How much of a card's memory the cell needs per byte of the allocated line: the usable memory it
        was calibrated at over the line's peak at the batch that fitted (the cautious end of the bracket)."""
        return self.usable_bytes / line.peak(self.fitted)


@dataclass(frozen=True)
class CardPlan:
    """One card's answer. ``largest_batch`` is ``None`` for a cell with no batch."""

    name: str
    total_bytes: int
    usable_bytes: int
    predicted_peak_bytes: float  # at the batch as written (or the fixed cell's peak)
    fits: bool  # the batch as written
    largest_batch: int | None = None
    largest_autocast_batch: int | None = None
    this_card: bool = False
    batch: int | None = None  # as written

    @functools.cached_property
    def _split(self) -> AccumulationPlan | None:
        """Where the batch as written does not fit but a smaller one does: the steps that keep it
        (``growth.accumulation``, the rule ``%oomfix``'s advice uses)."""
        if self.fits or self.batch is None or not self.largest_batch:
            return None
        return accumulation_plan(self.batch, self.largest_batch)

    @property
    def micro_batch(self) -> int | None:
        return None if self._split is None else self._split.micro

    @property
    def steps(self) -> int | None:
        return None if self._split is None else self._split.steps

    @property
    def last_batch(self) -> int | None:
        """The last step's batch, where no divisor is close (``None`` where the steps are equal)."""
        return None if self._split is None or self._split.exact else self._split.last

    @property
    def divisor_close(self) -> bool:
        """Whether the steps are equal and add up to the batch exactly."""
        return self.last_batch is None or self.last_batch == self.micro_batch

    def advice(self, batch: int | None, trains: bool = True) -> str:
        """What to do on this card, in words: gradient accumulation for a training cell, chunks otherwise."""
        if self.fits:
            return "fits as written"
        if batch is None:
            return "does not fit"
        if not self.largest_batch:
            return "does not fit even at batch 1: the part that does not depend on the batch is too large"
        steps = "accumulation steps" if trains else "chunks"
        text = f"batch {self.micro_batch} x {self.steps} {steps}"
        if not self.divisor_close:
            text += (
                f", the last of {self.last_batch} (no divisor of {batch} is close to {self.largest_batch}; or change "
                f"the effective batch to {(self.micro_batch or 0) * (self.steps or 0)})"
            )
        return text


def plan_card(
    card: tuple[str, int],
    line: Line | None,
    fixed_peak_bytes: int | None,
    batch: int | None,
    non_pytorch_bytes: int,
    margin: float,
    autocast_line: Line | None = None,
    this_card: bool = False,
    reserved_line: Line | None = None,
    ratio: float | None = None,
    replayed: Callable[[int], int] | None = None,
) -> CardPlan:
    """One card's plan (``card``: its name and the bytes it holds, ``cards.Card.total_bytes``) from the line
    (or, for a cell with no batch, its one measured peak). With a calibration ``ratio`` the line is scaled
    by it and the reserved line is not needed (see ``calibrated``); else, where the runs were recorded, the
    allocator's replay of them decides the largest batch (``replayed_largest``), the lines where they were
    not."""
    name, total = card
    if line is None or batch is None:
        usable = usable_bytes(total, non_pytorch_bytes, margin)
        peak = float(fixed_peak_bytes or 0)
        return CardPlan(name, total, usable, peak, peak <= usable, this_card=this_card)
    usable = usable_bytes(total, non_pytorch_bytes)
    measured = line  # the autocast column scales the float32 one by the measured per-sample bytes
    if ratio is not None:
        line, reserved_line = calibrated(line, ratio), None
    if ratio is None and replayed is not None:
        largest = replayed(usable)
    else:
        largest = plan_largest(line, usable, margin, reserved_line)
    peak = line.peak(batch)
    under_autocast = None
    if autocast_line is not None and autocast_line.slope_bytes > 0 and measured.slope_bytes > 0:
        under_autocast = autocast_largest(largest, measured, autocast_line)
    return CardPlan(name, total, usable, peak, batch <= largest, largest, under_autocast, this_card, batch)


@dataclass(frozen=True)
class PlanFigures:
    """What ``%%cudamem_plan`` measured and predicts, as figures (``plan.CapacityPlan`` shows them). Sizes in bytes.

    ``line`` is ``None`` for a cell with no batch (``fixed_peak_bytes`` is then its one peak);
    ``cards`` holds one ``CardPlan`` per card of the table, ``this_card`` the card it ran on.
    """

    runs: tuple[Run, ...]
    batch: int | None
    knob: str | None
    line: Line | None
    fixed_peak_bytes: int | None
    non_pytorch_bytes: int
    non_pytorch_how: str
    margin: float
    cards: tuple[CardPlan, ...]
    this_card: CardPlan | None
    agreements: tuple[Agreement, ...] = ()
    autocast_line: Line | None = None
    autocast_dtype: str | None = None
    notes: tuple[str, ...] = field(default=())
    trains: bool = True  # whether the cell trains (accumulation steps) or only runs a model (chunks)
    batch_where: str = ""  # where the batch lives, as the finder says it
    reserved_line: Line | None = None  # the line through the runs' reserved peaks (``None``: not read)
    calibration: Calibration | None = None  # with --calibrate (and a line): the largest batch found to fit, and where
    replayed: bool = False  # the largest batches come from the allocator's replay of the recorded runs
    workspaces_optional: bool = False  # ... with the workspaces libraries give back at once as optional

    @property
    def calibration_ratio(self) -> float | None:
        """A card's memory per byte of the allocated line, as the calibration measured it (``calibrated``)."""
        return None if self.calibration is None or self.line is None else self.calibration.ratio(self.line)

    @property
    def per_sample_bytes(self) -> float | None:
        return None if self.line is None else self.line.slope_bytes

    @property
    def fixed_bytes(self) -> float | None:
        return self.fixed_peak_bytes if self.line is None else self.line.intercept_bytes

    @property
    def predicted(self) -> dict[str, int | None]:
        """Card name -> largest batch that fits (``None`` for a cell with no batch)."""
        return {card.name: card.largest_batch for card in self.cards}

    def card(self, name: str) -> CardPlan:
        for card in self.cards:
            if card.name == name:
                return card
        raise KeyError(name)
