"""How a cell's GPU memory grows with its batch size: pure arithmetic, no torch, no IPython.

One room for the memory model that ``%oomfix``'s batch search and ``%%cudamem_plan`` both use:

- ``line``: the peak as ``fixed + per_sample x batch``: the line exactly through measured peaks (``Line``,
  what the plan reports) and with the steepest slope the allocator's rounding allows (``Growth``, what the
  search uses); what does not grow with the batch (parameters, their gradients, the optimizer's state);
  each request on a line of its own, and the bound the allocated bytes alone set;
- ``fitting``: which requests of two runs at two batches are one tensor, and whether a batch fits,
  replaying the requests on their lines, and the largest that does: from two runs (``paired_fittings``),
  from one (``fitting_from_one``), from one and a failure (``paired_with_failure``), run after run as the
  cell's next runs make them (``fits_in_a_row``);
- ``replay``: PyTorch's caching allocator replayed over a run's recorded requests under a cap, and a
  recorded run (``RecordedRun``) with its requests as another start makes them;
- ``accumulation``: one rule for gradient-accumulation steps that keep an effective batch.
"""

from .line import FixedMemory, Growth, batch_independent_requests, fit, lowest_slope, through_fixed, through_origin

__all__ = ["FixedMemory", "batch_independent_requests", "Growth", "fit", "lowest_slope", "through_fixed", "through_origin"]
