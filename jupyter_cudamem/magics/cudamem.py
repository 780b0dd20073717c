"""``%%cudamem``, ``%cudamem`` and ``%cudamem_history`` (filled in by the foundation work)."""

from __future__ import annotations

from IPython.core.magic import magics_class

from .base import CudaMemMagicsBase


@magics_class
class CudaMem(CudaMemMagicsBase):
    """Per-cell GPU memory. Configure with ``%config CudaMem.<option> = ...``."""
