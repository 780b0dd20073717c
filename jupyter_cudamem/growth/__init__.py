"""How a cell's GPU memory grows with its batch size: pure arithmetic, no torch, no IPython.

One room for the memory model that ``%oomfix``'s batch search and ``%%cudamem_plan`` both use:

- ``line``: the peak as ``fixed + per_sample x batch`` fitted from measured peaks, with the steepest
  slope the allocator's rounding allows;
- ``fixed``: what does not grow with the batch (parameters, their gradients, the optimizer's state),
  as read from the objects a cell trains, which of it a run creates, and which requests of one recorded
  run do not grow;
- ``through_points``: the same least squares, the line exactly through the points, with how far they
  agree with it (what the plan reports);
- ``replay``: PyTorch's caching allocator replayed over a run's recorded allocations under a cap;
- ``pairing``: which requests of two runs at two batches are one tensor, and the line each pair gives;
- ``fitting``: whether a batch fits, replaying the requests on those lines, and the largest that does:
  from two runs (``paired_fittings``), from one (``fitting_from_one``), from one and a failure
  (``paired_with_failure``);
- ``accumulation``: one rule for gradient-accumulation steps that keep an effective batch.
"""

from .fixed import FixedMemory, batch_independent_requests
from .line import Growth, fit, lowest_slope, through_fixed, through_origin

__all__ = ["FixedMemory", "batch_independent_requests", "Growth", "fit", "lowest_slope", "through_fixed", "through_origin"]
