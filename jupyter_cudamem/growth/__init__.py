"""How a cell's GPU memory grows with its batch size: pure arithmetic, no torch, no IPython.

The memory model ``%oomfix``'s batch search and ``%%cudamem_plan`` share: ``line`` (the peak as a line in
the batch, and what does not grow with it), ``fitting`` (whether a batch fits, by replaying a run's requests
on their lines), ``replay`` (PyTorch's caching allocator, replayed under a cap) and ``accumulation`` (one
rule for gradient-accumulation steps that keep an effective batch).
"""

from .line import FixedMemory, Growth, batch_independent_requests, fit, lowest_slope, through_fixed, through_origin

__all__ = ["FixedMemory", "batch_independent_requests", "Growth", "fit", "lowest_slope", "through_fixed",
           "through_origin"]
