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

from .at_peak import breakdown_at_peak, breakdowns_for
from .categories import CATEGORIES, MAX_MODULES, MODEL_STATE, OTHER_MODULE, Category, Phase
from .figures import Breakdown, OtherParts
from .tracked import TrackedPeak

__all__ = [
    "CATEGORIES", "MAX_MODULES", "MODEL_STATE", "OTHER_MODULE", "Breakdown", "Category", "OtherParts", "Phase",
    "TrackedPeak", "breakdown_at_peak", "breakdowns_for",
]
