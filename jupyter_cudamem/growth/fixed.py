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

from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from .replay import FREE, Event, block_bytes


@dataclass(frozen=True)
class FixedMemory:
    """The batch-independent part of a step, above the search's reference level, in bytes.

    ``parameters_bytes``: parameters and buffers of models the cell builds again (allocated by every
    run, before its batch's tensors); ``gradients_bytes``: gradients the step will create (parameters
    that require one and have none now); ``optimizer_state_bytes``: state the optimizers' first step
    will create; ``tensor_bytes``: the sizes of single parameter tensors (and of their half-precision
    copies, which autocast makes), so that a recorded request of one of these sizes is taken as a
    parameter's, a gradient's or the optimizer's, not as a batch's; ``gradient_sizes``: the size of each
    gradient the step will create (``gradients_bytes`` is their sum, where given), ``trainable_sizes`` of each
    parameter the step trains (each step's gradients, where a loop makes them anew), ``state_sizes`` of each
    tensor the optimizers' first step will create, ``built_sizes`` of each parameter and buffer the cell
    builds; ``trains``: whether the step runs a backward pass and an optimizer's step.
    """

    parameters_bytes: int = 0
    gradients_bytes: int = 0
    optimizer_state_bytes: int = 0
    tensor_bytes: frozenset[int] = field(default_factory=frozenset)
    gradient_sizes: tuple[int, ...] = ()
    trainable_sizes: tuple[int, ...] = ()
    state_sizes: tuple[int, ...] = ()
    built_sizes: tuple[int, ...] = ()
    trains: bool = False

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


def made_in_steps(events: Sequence[Event], steps: Sequence[tuple[int, int]]) -> frozenset[int]:
    """The keys of the requests made within ``steps`` (``(first event, event after the last)`` of each
    optimizer ``step()``, marked in the recorded history): its state and temporaries, the parameters' size
    at every batch."""
    return frozenset(events[index][1] for first, after in steps for index in range(first, min(after, len(events)))
                     if events[index][0] != FREE)


def step_gradients(events: Sequence[Event], fixed: FixedMemory, steps: Sequence[tuple[int, int]]) -> frozenset[int]:
    """Of each marked step, the keys of the gradients it applies: the parameter-sized requests made since the
    previous step ended that are still allocated when it begins, the latest first, at most as many of each
    size as the step trains parameters. An activation the size of a weight (at a batch of one) is freed by
    the backward pass, before the step; a gradient lives through it."""
    trained = fixed.trainable_sizes or fixed.gradient_sizes
    freed_at = {key: index for index, (kind, key, _, _) in enumerate(events) if kind == FREE}
    found: set[int] = set()
    since = 0
    for first, after in steps:
        wanted = Counter(block_bytes(size) for size in trained if size > 0)
        for index in range(min(first, len(events)) - 1, since - 1, -1):
            kind, key, size, _ = events[index]
            block = block_bytes(size)
            if kind != FREE and wanted[block] > 0 and freed_at.get(key, len(events)) >= first:
                found.add(key)
                wanted[block] -= 1
        since = after
    return frozenset(found)


def batch_independent_requests(events: Sequence[Event], left: Collection[int], fixed: FixedMemory,
                               steps: Sequence[tuple[int, int]] = ()) -> frozenset[int]:
    """The keys of one recorded run's requests that do not grow with the batch, read from their sizes
    and their lifetimes; the rest of the run is taken as proportional to its batch (``replay.fitting_from_one``).

    - a parameter-sized request the run left allocated (``left``): the optimizer's state made at its first
      step, a model the cell built, gradients it kept;
    - the gradients the step creates: of each size, as many as ``gradient_sizes`` says, the parameter-sized
      requests freed last (or never): a gradient lives from its layer's backward through the optimizer's
      step, an activation the size of a weight (at batch 1 where a sequence is as long as the model is
      wide) and its gradient are freed within the backward pass;
    - the optimizer's step: the parameter-sized requests made after the last of those gradients (state,
      foreach temporaries), from the first state tensor it made where it made one (a weight-sized
      activation's gradient may come after the last parameter's, and is freed before the step); where
      it made none, from when the backward pass freed the last weight-sized tensor it frees while the
      gradients live.

    Where the run's optimizer steps were marked (``steps``), the marks replace the last two rules: what each
    step made (``made_in_steps``) and the gradients each applied (``step_gradients``), in every iteration of
    a loop, where the rules above see only the last one.

    Any other parameter-sized request keeps growing with the batch: at batch 1 a weight-sized activation
    is indistinguishable by its size."""
    sized = fixed.is_parameter_sized
    allocations = [(index, key, size) for index, (kind, key, size, _) in enumerate(events)
                   if kind != FREE and sized(size)]
    found = {key for _, key, _ in allocations if key in left}
    if steps:
        return frozenset(found) | made_in_steps(events, steps) | step_gradients(events, fixed, steps)
    wanted = Counter(block_bytes(size) for size in fixed.gradient_sizes if size > 0)
    if not fixed.trains or not wanted:
        return frozenset(found)
    # Gradients the run left allocated are among what it left: of each size, what it left between the
    # parameters it built (made first) and the state its step made (made last).
    state = Counter(block_bytes(size) for size in fixed.state_sizes if size > 0)
    built = Counter(block_bytes(size) for size in fixed.built_sizes if size > 0)
    gradient_indices: list[int] = []
    left_by_block: dict[int, list[int]] = {}
    for index, key, size in allocations:
        if key in left:
            left_by_block.setdefault(block_bytes(size), []).append(index)
    for block, indices in left_by_block.items():
        gradients = indices[built[block]:len(indices) - state[block]]
        taken = gradients[-wanted[block]:] if wanted[block] > 0 else []
        wanted[block] -= len(taken)
        gradient_indices += taken
    freed_at = {key: index for index, (kind, key, _, _) in enumerate(events) if kind == FREE}
    for index, key, size in sorted(allocations, key=lambda a: (freed_at.get(a[1], len(events)), a[0]), reverse=True):
        block = block_bytes(size)
        if key not in found and wanted[block] > 0:
            found.add(key)
            wanted[block] -= 1
            gradient_indices.append(index)
    if gradient_indices:
        # The step begins where it makes its first state tensor, where this run made one: a weight-sized
        # activation's gradient, computed after the last parameter's, is freed within the backward pass,
        # before the step. Where it made none, the step begins once the weight-sized tensors made before
        # the last gradient and freed while every gradient lives (activations at a batch of one, freed by
        # the backward pass) are freed: such an activation's gradient is made while they live.
        last_gradient = max(gradient_indices)
        gradients_live_until = min(freed_at.get(events[index][1], len(events)) for index in gradient_indices)
        backward_frees = [freed_at[key] for index, key, _ in allocations if index < last_gradient
                          and key not in found and freed_at.get(key, len(events)) < gradients_live_until]
        step_begins = next((index for index, key, _ in allocations if index > last_gradient and key in left),
                           max(backward_frees, default=last_gradient))
        found.update(key for index, key, _ in allocations if index >= step_begins and index > last_gradient)
    return frozenset(found)
