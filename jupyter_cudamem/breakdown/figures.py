"""A cell's peak by category and by module (``Breakdown``), summing to the allocator's peak, and what its
``Category.OTHER`` is made of (``OtherParts``); plain values for JSON."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .categories import CATEGORIES, MODEL_STATE, OTHER_MODULE, Category, Phase


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
