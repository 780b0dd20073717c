"""The advice the extension gives from numbers and facts, in one room.

Three callers, one vocabulary: ``%%cudamem`` turns a measurement into one-line hints
(``measurement_hints``); ``%oomfix``'s diagnosis says what to try for each verdict (``too_big_advice``,
``fragmentation_advice``...); its outcome ends with advice that fits the cell and what fitted
(``build_suggestions``: gradient accumulation through the place the batch lives, no_grad,
checkpointing, a GradScaler, expandable segments). Pure text from numbers and facts: nothing here
measures or decides a verdict. What to change about each holder of what a cell left is written with
its description, beside the attribution that names its cause (``attribution.text.leak_advice``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from .units import GiB, MiB
from .attribution.left import DEFAULT_THRESHOLD_BYTES
from .breakdown import Category
from .batch.knobs import KnobKind
from .cell.traits import CellTraits
from .growth.accumulation import (
    CLOSE_DIVISOR_FRACTION,
    AccumulationPlan,
    accumulation_plan,
    largest_divisor_at_most,
)
from .measure import DeviceMeasurement, Measurement
from .units import format_bytes

CACHED_GROWTH_HINT_BYTES = 1 * GiB
# Where %%cudamem names who holds what a cell left; the hint stands in for that report where none was made.
LEFT_ALLOCATED_HINT_BYTES = DEFAULT_THRESHOLD_BYTES
OUTSIDE_PYTORCH_HINT_BYTES = 256 * MiB
NEAR_FULL_FRACTION = 0.85
EXPANDABLE = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"


# -- %%cudamem: hints from a measurement --------------------------------------------------------------
def device_hints(measured: DeviceMeasurement, left_attributed: bool = False, failed_out_of_memory: bool = False) -> list[str]:
    """Hints for one device, most useful first; ``left_attributed`` when the report names who holds
    what the cell left (then the left-allocated hint would only repeat it); ``failed_out_of_memory``
    when the cell ended in an OOM (whose own retry is no sign of fragmentation)."""
    hints: list[str] = []
    allocated = measured.allocated_delta_bytes or 0
    reserved = measured.reserved_delta_bytes or 0
    total = measured.limit_bytes  # the per-process cap where one is set: that is where this process runs out
    peak = measured.peak_allocated_bytes
    if peak is not None and total and peak / total >= NEAR_FULL_FRACTION:
        whole = "the card" if measured.cap_bytes is None else f"the {format_bytes(total)} per-process cap"
        hints.append(f"peak is {peak / total:.0%} of {whole}: close to out of memory")
    if reserved - allocated >= CACHED_GROWTH_HINT_BYTES:
        hints.append(
            f"reserved grew {format_bytes(reserved - allocated)} more than allocated: cached blocks "
            "PyTorch keeps for reuse; torch.cuda.empty_cache() returns them to the driver"
        )
    if allocated >= LEFT_ALLOCATED_HINT_BYTES and not left_attributed:
        hints.append(
            f"the cell left {format_bytes(allocated)} allocated: tensors still referenced by variables, autograd "
            "graphs, module hooks or Out[...]; %%cudamem names who holds it past "
            "%config CudaMem.attribute_threshold"
        )
    outside = measured.outside_pytorch_delta_bytes
    if outside is not None and outside >= OUTSIDE_PYTORCH_HINT_BYTES:
        first_use = measured.before.allocator is not None and measured.before.allocator.reserved_bytes == 0
        cause = "the CUDA context created on first use, " if first_use and measured.before.process_bytes == 0 else ""
        hints.append(
            f"{format_bytes(outside)} more in use outside PyTorch's allocator ({cause}cuBLAS/cuDNN workspaces, "
            "CuPy, JAX or other libraries)"
        )
    before, after = measured.before.allocator, measured.after.allocator
    # Before raising an OOM the allocator frees its cache and retries once: that retry is the failure
    # itself (a request larger than all the room there is retries too), not a sign of fragmentation;
    # %oomfix's diagnosis judges the failure from its figures.
    retries = 0 if before is None or after is None else after.num_alloc_retries - before.num_alloc_retries
    retries -= 1 if failed_out_of_memory else 0
    if retries > 0:
        hints.append(
            f"the allocator had to free its cache and retry {retries} "
            f"time(s): memory pressure or fragmentation; {EXPANDABLE} may help"
        )
    if not measured.peak_is_block_peak:
        hints.append("peak counters were not reset (reset_peak is off): peak is since the last reset, not this cell's")
    return hints


def measurement_hints(measurement: Measurement, left_attributed: bool = False) -> list[str]:
    hints: list[str] = []
    out_of_memory = measurement.error in ("OutOfMemoryError", "OutOfMemory")
    if out_of_memory:
        hints.append("the cell ran out of GPU memory: run %oomfix in the next cell to diagnose and fix it")
    for device in measurement.devices:
        prefix = f"{device.device.label}: " if len(measurement.devices) > 1 else ""
        hints.extend(prefix + hint for hint in device_hints(device, left_attributed, out_of_memory))
    return hints


# -- %oomfix's diagnosis: what to try for each verdict ------------------------------------------------
_SMALLER = "a smaller batch, shorter sequences or smaller images (%oomfix finds the batch size and reruns)"
_AUTOCAST = 'torch.autocast("cuda", dtype=torch.bfloat16) halves activations'


def too_big_advice(capped: bool) -> list[str]:
    """One allocation larger than the process may ever have."""
    advice = [_SMALLER, _AUTOCAST]
    if capped:
        advice.append("raise the cap: torch.cuda.set_per_process_memory_fraction(...) set it")
    return advice


def fragmentation_advice(reserved_unallocated_bytes: int | None = None) -> list[str]:
    """``reserved_unallocated_bytes``: what the allocator held cached but unallocated at the failure; the
    ``empty_cache()`` advice is given only when there is such memory to give back."""
    advice = [
        (
            f"set {EXPANDABLE} before CUDA starts (in the environment, or os.environ at the top of the "
            "notebook, then restart the kernel) so the allocator can grow segments instead of splitting them"
        ),
    ]
    if reserved_unallocated_bytes:
        advice.append(
            f"torch.cuda.empty_cache() between phases that allocate very different sizes: it gives back the "
            f"{format_bytes(reserved_unallocated_bytes)} cached but unallocated, so the next phase cuts its "
            "blocks afresh"
        )
    return advice


def held_by_ipython_advice() -> list[str]:
    return ["%oomfix releases it (your variables are kept); %oomfix --dry-run only reports"]


def held_by_namespace_advice(largest: list[tuple[str, int]]) -> list[str]:
    """``largest``: (variable name, bytes only it holds) of the biggest holders among the user's variables."""
    return [
        f"%oomfix --del {name} if you no longer need it (frees up to {format_bytes(size)})" for name, size in largest
    ]


def needs_more_advice() -> list[str]:
    """The cell needs more than is left: shrink or cheapen the computation."""
    return [
        "a smaller batch (%oomfix finds the batch size and reruns; gradient accumulation keeps the effective batch)",
        'torch.autocast("cuda", dtype=torch.bfloat16) for activations; torch.no_grad() for inference',
        "activation checkpointing (torch.utils.checkpoint) for deep models",
    ]


def cached_unusable_advice(reserved_unallocated_bytes: int) -> str:
    return f"{EXPANDABLE} reduces the {format_bytes(reserved_unallocated_bytes)} cached but unusable"


# -- %oomfix's outcome: advice with code that fits the cell -------------------------------------------
@dataclass(frozen=True)
class Suggestion:
    """Advice with code the user can paste."""

    title: str
    why: str
    code: str = ""


def accumulation_sentence(plan: AccumulationPlan) -> str:
    """What the plan keeps and, where it cannot keep everything, what changes, with the arithmetic."""
    if plan.exact:
        return (
            f"keeps the effective batch of {plan.effective} exactly: {plan.steps} steps of {plan.micro} "
            f"per optimizer step ({plan.steps} x {plan.micro} = {plan.effective})"
        )
    smallest_close = math.ceil(plan.fitted * CLOSE_DIVISOR_FRACTION)
    best = largest_divisor_at_most(plan.effective, plan.fitted)
    return (
        f"no micro-batch between {smallest_close} and {plan.fitted} divides the effective batch of "
        f"{plan.effective} (the largest divisor that fits is {best}), so something changes: either the "
        f"last step is smaller ({plan.steps - 1} x {plan.micro} + {plan.last} = {plan.effective}; scale each "
        f"step's loss by its size / {plan.effective} instead of 1 / {plan.steps}) or the effective batch "
        f"changes to {plan.rounded_effective} ({plan.steps} x {plan.micro})"
    )


def _accumulation_code(plan: AccumulationPlan, traits: CellTraits, batch_home: KnobKind | None) -> str:
    micro, steps = plan.micro, plan.steps
    if not plan.exact:
        # Libraries' accumulation takes equal steps: their code is the rounded effective batch, said so.
        rounded = f"  # effective batch {plan.rounded_effective}, not {plan.effective}"
    else:
        rounded = ""
    if traits.hf_trainer or batch_home is KnobKind.TRAINER:
        return f"TrainingArguments(..., per_device_train_batch_size={micro}, gradient_accumulation_steps={steps}){rounded}"
    if batch_home is KnobKind.LIGHTNING:
        return f"L.Trainer(..., accumulate_grad_batches={steps})  # with the datamodule's batch_size={micro}{rounded.replace('  #', ';')}"
    if not plan.exact:
        return (
            f"for x, y in loader:  # loader with batch_size={plan.effective}, as before\n"
            f"    for xs, ys in zip(x.split({micro}), y.split({micro})):  # {steps - 1} x {micro} + {plan.last}\n"
            f"        loss = loss_fn(model(xs), ys) * (len(xs) / len(x))  # weight by the step's share\n"
            f"        loss.backward()\n"
            f"    optimizer.step()\n"
            f"    optimizer.zero_grad()"
        )
    return (
        f"accumulation_steps = {steps}  # {steps} x {micro} = {steps * micro} samples per optimizer step\n"
        f"for i, (x, y) in enumerate(loader):  # loader with batch_size={micro}\n"
        f"    loss = loss_fn(model(x), y) / accumulation_steps\n"
        f"    loss.backward()\n"
        f"    if (i + 1) % accumulation_steps == 0:\n"
        f"        optimizer.step()\n"
        f"        optimizer.zero_grad()"
    )


def build_suggestions(
    source: str,
    traits: CellTraits,
    batch_before: int | None,
    batch_after: int | None,
    autocast_dtype: str | None,
    fragmented: bool,
    autocast_fitted: bool,
    batch_home: KnobKind | None = None,
) -> tuple[Suggestion, ...]:
    """Advice that fits the cell: keep the effective batch (through where the batch lives: a Trainer's
    arguments, a Lightning Trainer, or a plain loop), save activations, beat fragmentation."""
    found: list[Suggestion] = []
    trains = traits.trains or batch_home in (KnobKind.TRAINER, KnobKind.LIGHTNING)
    if batch_before and batch_after and batch_after < batch_before and trains:
        plan = accumulation_plan(batch_before, batch_after)
        found.append(
            Suggestion("gradient accumulation", accumulation_sentence(plan), _accumulation_code(plan, traits, batch_home))
        )
    if not trains and not traits.no_grad and traits.calls_model:
        found.append(
            Suggestion(
                "torch.no_grad() for inference",
                "the cell computes no gradients, yet autograd keeps every activation for a backward pass",
                "with torch.inference_mode():  # or torch.no_grad()\n    outputs = model(inputs)",
            )
        )
    if trains:
        found.append(
            Suggestion(
                "activation checkpointing",
                "recomputes activations in the backward pass instead of storing them: less memory for about a third more compute",
                "from torch.utils.checkpoint import checkpoint\n"
                "def forward(self, x):\n"
                "    for block in self.blocks:\n"
                "        x = checkpoint(block, x, use_reentrant=False)\n"
                "    return x",
            )
        )
    if autocast_fitted and autocast_dtype == "float16" and trains:
        found.append(
            Suggestion(
                "GradScaler for float16 training",
                "float16 gradients underflow without loss scaling (bfloat16 needs none; this card lacks it)",
                'scaler = torch.amp.GradScaler("cuda")  # torch < 2.3: torch.cuda.amp.GradScaler()\n'
                'with torch.autocast("cuda", dtype=torch.float16):\n'
                "    loss = loss_fn(model(x), y)\n"
                "scaler.scale(loss).backward()\n"
                "scaler.step(optimizer)\n"
                "scaler.update()\n"
                "optimizer.zero_grad()",
            )
        )
    if fragmented:
        found.append(
            Suggestion(
                "expandable segments",
                "the failure looks like fragmentation (much memory reserved but unallocated); this allocator "
                "setting takes effect only in a fresh kernel, before CUDA is first used",
                'import os\nos.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"  # first cell, before import torch',
            )
        )
    return tuple(found)


# -- what fits the category that fills a peak (``breakdown``) -----------------------------------------
@dataclass(frozen=True)
class CategoryAdvice:
    """One change that shrinks a category, and how many bytes of the cell's peak (or of what a failed cell
    needed) it would save (``up_to``: at most that many; the rest depends on the model)."""

    category: Category
    action: str
    saves_bytes: int
    up_to: bool = False

    def text(self, whole: str = "the peak") -> str:
        """``action: saves about 1.14 GiB of the peak`` (``whole`` names what it is saved from)."""
        amount = f"{'up to ' if self.up_to else 'about '}{format_bytes(self.saves_bytes)}"
        return f"{self.action}: saves {amount} of {whole}"


def category_advice(categories: Mapping[Category, int], in_step: bool = False,
                    graph_kept: bool | None = None) -> list[CategoryAdvice]:
    """What to change when the largest of ``categories`` (bytes) is the one to shrink.

    The figures assume 32-bit floats, as PyTorch makes them by default: bf16 halves a category. Adam's
    state is made like its parameter, so a bf16 model halves parameters, gradients and state together.
    ``in_step``: the peak was reached in the optimizer's step, so the temporaries are the step's.
    ``graph_kept``: whether the run kept an autograd graph (``False``: what it made was not kept for a
    backward pass, as in ``generate()``, which runs under ``no_grad`` itself, so neither ``no_grad`` nor
    checkpointing saves any of it; ``None``: unknown).
    """
    size = {category: int(categories.get(category, 0)) for category in Category}
    dominant = max(Category, key=lambda category: size[category])
    if size[dominant] <= 0:
        return []
    state = size[Category.PARAMETERS] + size[Category.GRADIENTS] + size[Category.OPTIMIZER_STATE]
    if dominant is Category.OPTIMIZER_STATE:
        return [
            CategoryAdvice(dominant, "a lower-precision optimizer (its state in bf16; 8-bit states save more)",
                           size[dominant] // 2),
            CategoryAdvice(dominant, "fused=True (or foreach=False) on the optimizer: its step then makes no "
                           "temporary copy of the state", size[Category.TEMPORARIES] if in_step else
                           size[Category.PARAMETERS], up_to=True),
        ]
    if dominant is Category.ACTIVATIONS:
        shrink = [
            CategoryAdvice(dominant, "half the batch (gradient accumulation keeps the effective batch)",
                           size[dominant] // 2),
            CategoryAdvice(dominant, 'torch.autocast("cuda", dtype=torch.bfloat16) around the forward pass',
                           size[dominant] // 2),
        ]
        if graph_kept is False:
            return shrink
        return shrink + [
            CategoryAdvice(dominant, "activation checkpointing (torch.utils.checkpoint) around each block: "
                           "only the blocks' inputs are kept for backward", size[dominant], up_to=True),
        ] + ([CategoryAdvice(dominant, "torch.no_grad() (or torch.inference_mode()) if the cell does not train: "
                             "nothing is kept for backward", size[dominant], up_to=True)]
             if size[Category.GRADIENTS] == 0 else [])
    if dominant is Category.PARAMETERS:
        return [CategoryAdvice(dominant, "a smaller dtype: model.to(torch.bfloat16) before the optimizer is made "
                               "halves parameters, gradients and optimizer state", state // 2)]
    if dominant is Category.GRADIENTS:
        return [CategoryAdvice(dominant, "freeze what you do not train (requires_grad_(False)), or step the "
                               "optimizer in backward so each gradient is freed once used", size[dominant],
                               up_to=True)]
    if dominant is Category.TEMPORARIES:
        if in_step:
            return [CategoryAdvice(dominant, "fused=True (or foreach=False) on the optimizer: its step then "
                                   "makes no temporary copies", size[dominant], up_to=True)]
        return [CategoryAdvice(dominant, "half the batch, or split the largest operation into chunks",
                               size[dominant] // 2)]
    return [CategoryAdvice(dominant, "keep data and results on the CPU and move one batch at a time to the GPU",
                           size[dominant], up_to=True)]
