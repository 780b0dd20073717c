"""What a training or inference step holds whatever its batch: parameters, their gradients, the
optimizer's state. Pure arithmetic on figures read from the objects a cell trains
(``attribution.training_state`` reads them); no torch here.

Why it matters: where a transformer or a ViT is fine-tuned, the largest batch that fits is 1 to 50, and
weights, gradients and the optimizer's state are most of the memory. A line through one measured peak
and zero then says almost every byte grows with the batch, and lands far too low; a replay that scales
every request of one run with the batch scales AdamW's two state tensors per parameter too. Knowing
which bytes do not grow fixes both.

What a run creates: a model the cell builds is set aside before each rerun (moved to the host) and built
again by it, so its parameters are allocated above the search's reference level in every run. A
gradient appears at the first ``backward()`` where ``.grad`` is ``None``; AdamW's state (two tensors of
each parameter's shape and dtype) at the optimizer's first ``step()``. A run that failed before its
first step created no state; a probe that ran one step leaves it, and later runs start with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from .replay import block_bytes


@dataclass(frozen=True)
class FixedMemory:
    """The batch-independent part of a step, above the search's reference level, in bytes.

    ``parameters_bytes``: parameters and buffers of models the cell builds again (allocated by every
    run, before its batch's tensors); ``gradients_bytes``: gradients the step will create (parameters
    that require one and have none now); ``optimizer_state_bytes``: state the optimizers' first step
    will create; ``tensor_bytes``: the sizes of single parameter tensors (and of their half-precision
    copies, which autocast makes), so that a recorded request of one of these sizes is taken as a
    parameter's, a gradient's or the optimizer's, not as a batch's.
    """

    parameters_bytes: int = 0
    gradients_bytes: int = 0
    optimizer_state_bytes: int = 0
    tensor_bytes: frozenset[int] = field(default_factory=frozenset)

    @property
    def total_bytes(self) -> int:
        """All of it: what a step holds at its optimizer step, before its batch's tensors."""
        return self.parameters_bytes + self.gradients_bytes + self.optimizer_state_bytes

    @property
    def surely_held_bytes(self) -> int:
        """What every moment of a run holds after its model is built: the parameters it builds.
        Gradients and state exist only from the backward pass and the step on, so a peak in the
        forward pass need not hold them."""
        return self.parameters_bytes

    def is_parameter_sized(self, requested_bytes: int) -> bool:
        """Whether a request is the size of a parameter tensor (so its own, its gradient's or its state's)."""
        return block_bytes(requested_bytes) in self._blocks

    @cached_property
    def _blocks(self) -> frozenset[int]:
        return frozenset(block_bytes(size) for size in self.tensor_bytes if size > 0)
