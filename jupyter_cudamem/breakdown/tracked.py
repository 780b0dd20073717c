"""What a tracker saw at its peak (``TrackedPeak``), as ``sources.torch_breakdown`` fills it: tensors only,
before it is made to agree with the allocator."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .categories import Category, Phase


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
