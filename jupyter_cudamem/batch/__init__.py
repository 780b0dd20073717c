"""Where a notebook keeps its batch size, and changing it there.

``find_batch`` (``finder``) reads a failed cell, the namespace and IPython's input history and
returns every knob that sets the cell's batch, with its provenance (``knobs``, traced by
``provenance``); ``BatchChange`` (``change``) changes one where it lives for a try, puts it back,
and shows the diff of every cell that should change. Finding is not changing: the next kind of knob
is one reader in ``namespace_knobs.KNOB_READERS`` and, if it lives somewhere new, one setter in ``change``.
Used by ``%oomfix``; knows nothing of IPython's shell or of GPUs.
"""

from .change import BatchChange, rebuilt_loader
from .finder import find_batch
from .knobs import BatchFinding, Knob, KnobKind, ObjectPath, Step
from .names import batch_like

__all__ = [
    "BatchChange",
    "BatchFinding",
    "Knob",
    "KnobKind",
    "ObjectPath",
    "Step",
    "batch_like",
    "find_batch",
    "rebuilt_loader",
]
