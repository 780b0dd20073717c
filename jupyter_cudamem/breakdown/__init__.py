"""Where a cell's peak went: bytes by category (parameters, gradients, optimizer state, activations,
temporaries, other) and by module, at the moment of the peak.

Pure arithmetic over what a tracker saw (``TrackedPeak``, filled by ``sources.torch_breakdown``) and
the allocator's measured peak: no torch, no IPython. The tracker counts tensors; the allocator counts
everything it handed out (cuBLAS workspaces, scratch inside one operation, tensors that existed before
the cell and belong to no model). ``breakdown_at_peak`` makes the two agree: the categories and the
modules each sum to the measured peak, ``Category.OTHER`` and the module ``OTHER_MODULE`` taking what
the tracker did not see.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum


class Category(Enum):
    """What a block of memory is for. The value is how reports and result files name it."""

    PARAMETERS = "parameters"  # a model's parameters and buffers
    GRADIENTS = "gradients"  # the parameters' .grad
    OPTIMIZER_STATE = "optimizer_state"  # what optimizer.state holds (Adam's moments, momentum)
    ACTIVATIONS = "activations"  # made in a forward pass with autograd on: what backward reads
    TEMPORARIES = "temporaries"  # made in backward, in the optimizer's step, or in a forward pass without autograd
    OTHER = "other"  # made outside any model (inputs, data, losses), or not seen as a tensor at all

    @property
    def words(self) -> str:
        return self.value.replace("_", " ")


CATEGORIES: tuple[Category, ...] = tuple(Category)

# The categories that do not grow with the batch: what a model and its optimizer hold between steps.
MODEL_STATE: tuple[Category, ...] = (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATE)


class Phase(Enum):
    """Where the cell was when the peak happened."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER_STEP = "optimizer step"
    OUTSIDE = "outside any model"  # the cell's own code between models' calls


OTHER_MODULE = "other"
"""The module row that takes memory no model's module made or owns, and what the tracker did not see."""

MAX_MODULES = 12
"""Module rows shown; smaller ones are added to ``OTHER_MODULE``."""


@dataclass(frozen=True)
class TrackedPeak:
    """What a tracker saw on one device at the highest point of the tensors it counted.

    ``held`` is bytes by (category, module): the module is a top-level child of a model the cell ran
    (``model.encoder``), the model itself for what its own ``forward`` made outside its children, or ""
    for none. ``expected`` is numel x element size of the parameters (and buffers), gradients and
    optimizer state of the models and optimizers the cell touched, as they were at the end of the cell.
    """

    device: str
    held: Mapping[tuple[Category, str], int]
    phase: Phase
    expected: Mapping[Category, int] = field(default_factory=dict)
    models: tuple[str, ...] = ()
    tracked_at_start: int = 0  # what it counted as the cell started: the models and optimizers bound to names


@dataclass(frozen=True)
class OtherParts:
    """What ``Category.OTHER`` is made of, as far as the figures tell (bytes, summing to it).

    ``outside_models``: tensors the cell made outside any model (inputs, a loss computed by a function).
    ``before_cell``: memory allocated when the cell started that belongs to no model or optimizer bound to
    a name (data, earlier results, cuBLAS's workspace from an earlier cell), at most: some of it may have
    been freed before the peak. ``unseen``: the rest, what no tensor the tracker saw holds (a workspace
    made in this cell, scratch inside one operation).
    """

    outside_models: int
    before_cell: int
    unseen: int


@dataclass(frozen=True)
class Breakdown:
    """A cell's peak on one device, by category and by module; both sum to ``peak_bytes``.

    ``cells`` holds bytes by (module row, category); ``tracked_bytes`` is what the tracker counted at
    its peak (the rest is ``Category.OTHER``); ``scaled`` says the tracker counted more than the
    allocator's peak (a peak counter not reset for the cell) and its figures were scaled down to it.
    """

    device: str
    peak_bytes: int
    cells: Mapping[tuple[str, Category], int]
    phase: Phase
    expected: Mapping[Category, int]
    tracked_bytes: int
    models: tuple[str, ...] = ()
    scaled: bool = False
    other_parts: OtherParts | None = None  # None where the allocation at the cell's start is unknown

    @property
    def categories(self) -> dict[Category, int]:
        """Bytes by category, every category present, summing to ``peak_bytes``."""
        totals = dict.fromkeys(CATEGORIES, 0)
        for (_, category), size in self.cells.items():
            totals[category] += size
        return totals

    @property
    def modules(self) -> dict[str, int]:
        """Bytes by module row, largest first, ``OTHER_MODULE`` last; summing to ``peak_bytes``."""
        totals: dict[str, int] = {}
        for (module, _), size in self.cells.items():
            totals[module] = totals.get(module, 0) + size
        other = totals.pop(OTHER_MODULE, 0)
        ordered = dict(sorted(totals.items(), key=lambda item: -item[1]))
        ordered[OTHER_MODULE] = other
        return ordered

    def module_categories(self, module: str) -> dict[Category, int]:
        return {category: self.cells.get((module, category), 0) for category in CATEGORIES}

    @property
    def dominant(self) -> Category:
        """The category holding the most of the peak."""
        categories = self.categories
        return max(CATEGORIES, key=lambda category: categories[category])

    def as_dict(self) -> dict[str, object]:
        """Plain values for JSON: bytes by category name and by module, the phase, the expected figures."""
        return {
            "device": self.device,
            "peak_bytes": self.peak_bytes,
            "phase": self.phase.value,
            "categories": {category.value: size for category, size in self.categories.items()},
            "modules": self.modules,
            "expected": {category.value: self.expected.get(category, 0) for category in MODEL_STATE},
            "tracked_bytes": self.tracked_bytes,
            "other_parts": None if self.other_parts is None else {
                "outside_models": self.other_parts.outside_models,
                "before_cell": self.other_parts.before_cell,
                "unseen": self.other_parts.unseen,
            },
        }


def _scaled(values: Mapping[tuple[str, Category], int], total: int) -> dict[tuple[str, Category], int]:
    """``values`` scaled to sum to ``total`` exactly (largest remainders get the leftover bytes)."""
    whole = sum(values.values())
    if whole <= 0:
        return {key: 0 for key in values}
    shares = {key: size * total / whole for key, size in values.items()}
    result = {key: int(share) for key, share in shares.items()}
    leftover = total - sum(result.values())
    for key in sorted(shares, key=lambda k: -(shares[k] - result[k]))[:leftover]:
        result[key] += 1
    return result


def _other_parts(rest: int, tracked: TrackedPeak, allocated_at_start: int | None) -> OtherParts | None:
    if allocated_at_start is None:
        return None
    outside = min(sum(size for (category, _), size in tracked.held.items() if category is Category.OTHER), rest)
    before = min(max(allocated_at_start - tracked.tracked_at_start, 0), rest - outside)
    return OtherParts(outside_models=outside, before_cell=before, unseen=rest - outside - before)


def breakdown_at_peak(
    peak_bytes: int, tracked: TrackedPeak, max_modules: int = MAX_MODULES, allocated_at_start: int | None = None
) -> Breakdown:
    """The tracker's figures made to sum to the allocator's ``peak_bytes``.

    What the tracker counted as ``Category.OTHER`` and all it did not see become one figure, the
    rest of the peak: the tracker's own "other" is tensors outside any model, which the allocator
    counts too, so counting both would count them twice. Memory a tracker cannot see (cuBLAS's
    workspace, scratch an operation frees before it returns, tensors older than the cell outside any
    model) is in that rest as well; with ``allocated_at_start`` (the allocator's figure as the cell
    started) the rest is split into ``OtherParts``. Modules beyond the ``max_modules`` largest join
    ``OTHER_MODULE``.
    """
    known: dict[tuple[str, Category], int] = {}
    for (category, module), size in tracked.held.items():
        if category is Category.OTHER or size <= 0:
            continue
        key = (module or OTHER_MODULE, category)
        known[key] = known.get(key, 0) + size
    tracked_bytes = sum(known.values())
    scaled = tracked_bytes > peak_bytes
    cells = _scaled(known, peak_bytes) if scaled else dict(known)
    rest = peak_bytes - sum(cells.values())
    cells[(OTHER_MODULE, Category.OTHER)] = cells.get((OTHER_MODULE, Category.OTHER), 0) + rest
    module_totals: dict[str, int] = {}
    for (module, _), size in cells.items():
        if module != OTHER_MODULE:
            module_totals[module] = module_totals.get(module, 0) + size
    kept = set(sorted(module_totals, key=lambda m: -module_totals[m])[:max_modules])
    folded: dict[tuple[str, Category], int] = {}
    for (module, category), size in cells.items():
        row: tuple[str, Category] = (module if module in kept else OTHER_MODULE, category)
        folded[row] = folded.get(row, 0) + size
    return Breakdown(
        device=tracked.device,
        peak_bytes=peak_bytes,
        cells=folded,
        phase=tracked.phase,
        expected=dict(tracked.expected),
        tracked_bytes=tracked_bytes,
        models=tracked.models,
        scaled=scaled,
        other_parts=_other_parts(rest, tracked, allocated_at_start),
    )


def breakdowns_for(
    peaks: Mapping[str, int], tracked: Mapping[str, TrackedPeak], allocated_at_start: Mapping[str, int] | None = None
) -> tuple[Breakdown, ...]:
    """A breakdown for each measured device (``{"cuda:0": peak bytes}``) the tracker saw; with each
    device's allocated bytes as the cell started, ``Category.OTHER`` is split into its parts.

    A tracker of one device paired with one measured device pairs them whatever their names (a tracker
    of CPU tensors standing in for a GPU in tests).
    """
    start = allocated_at_start or {}
    if len(peaks) == 1 and len(tracked) == 1:
        [(device, peak)] = peaks.items()
        [seen] = tracked.values()
        return (breakdown_at_peak(peak, seen, allocated_at_start=start.get(device)),)
    # a device the tracker saw no tensor on: all of its peak is "other"
    return tuple(
        breakdown_at_peak(peak, tracked.get(device) or TrackedPeak(device, {}, Phase.OUTSIDE),
                          allocated_at_start=start.get(device))
        for device, peak in peaks.items()
    )
