"""The plan's runs (jupyter_cudamem/capacity/runs.py) over the fake hardware: each run starts clean.

- A cell that binds the tensors it creates (``x = ...``, ``preds = ...``) must not carry the previous
  run's tensors into the next run: they are set aside before each run (``oomfix.leftovers``).
- Each run's reserved peak is its own (the cache is emptied before it), and a card is limited by what
  the allocator reserves: the plan follows the reserved line where it needs more than the margin.
"""

from __future__ import annotations

import math

import pytest

from fakes import FakeMover, FakeTensor, GiB, MiB
from jupyter_cudamem.capacity.plan import DEFAULT_MARGIN, build_plan
from jupyter_cudamem.errors import CudaMemError
from jupyter_cudamem.capacity.runs import Runner, judge, measure_runs
from jupyter_cudamem.measure import Meter
from jupyter_cudamem.oomfix.leftovers import set_aside

PER_SAMPLE = 20 * MiB
WEIGHTS = GiB


class NamespaceBatch:
    def __init__(self, namespace, source, batch):
        self.namespace, self.source, self.original = namespace, source, batch

    def apply(self, batch):
        self.namespace["batch"] = batch
        return self.source

    def restore(self):
        self.namespace["batch"] = self.original


class Oom(RuntimeError):
    pass


def plan_runs(hardware, machine, namespace, source, mover=True):
    runner = Runner(Meter(hardware, reset_peak=True), lambda s: exec(s, namespace), lambda e: isinstance(e, Oom),
                    release=hardware.allocator.empty_cache,
                    set_aside=(lambda s: set_aside(namespace, s, FakeMover(machine))) if mover else None)
    measured = measure_runs(runner, source, 64, NamespaceBatch(namespace, source, 64))
    return measured, judge(measured, 64)


CELL = "x = make(batch)\npreds = make(batch)\n"


def namespace_for(machine):
    def make(batch):
        return FakeTensor(PER_SAMPLE * batch, machine=machine)

    return {"make": make, "batch": 64}


def test_tensors_the_cell_binds_again_are_set_aside_before_each_run(hardware, machine):
    machine.allocate(0, WEIGHTS)
    namespace = namespace_for(machine)
    measured, judged = plan_runs(hardware, machine, namespace, CELL)
    # x and preds at the batch: 2 x PER_SAMPLE a sample, the weights the fixed part
    assert judged.line.slope_bytes == 2 * PER_SAMPLE
    assert judged.line.intercept_bytes == WEIGHTS
    # the namespace ends as after a normal run at the batch as written
    assert namespace["batch"] == 64 and namespace["x"].untyped_storage().nbytes() == PER_SAMPLE * 64
    assert machine.gpus[0].allocated == WEIGHTS + 2 * 64 * PER_SAMPLE


def test_without_setting_aside_the_smaller_run_carries_the_larger_runs_tensors(hardware, machine):
    """What the fix is for: the half run builds its x and preds while the batch as written's are alive,
    so its start and peak carry them, and the plan is refused (or, where the starts happen to agree, wrong)."""
    machine.allocate(0, WEIGHTS)
    with pytest.raises(CudaMemError, match="not repeatable"):
        plan_runs(hardware, machine, namespace_for(machine), CELL, mover=False)


def test_a_run_that_runs_out_of_memory_gives_the_set_aside_tensors_back(hardware, machine):
    machine.allocate(0, WEIGHTS)
    namespace = namespace_for(machine)
    exec(CELL, namespace)
    runner = Runner(Meter(hardware, reset_peak=True), lambda s: exec(s, namespace), lambda e: isinstance(e, Oom),
                    release=hardware.allocator.empty_cache,
                    set_aside=lambda s: set_aside(namespace, s, FakeMover(machine)))

    def failing(batch):
        raise Oom("CUDA out of memory")

    namespace["make"] = failing
    run = runner.once("as written", CELL, 64)
    assert run.oom and "x" in namespace and "preds" in namespace and namespace["x"].is_cuda


def wasteful_namespace(machine, waste):
    def step(batch):
        size = PER_SAMPLE * batch
        machine.allocate(0, size, slack=int(waste * size))  # the allocator reserves more than it hands out
        machine.free(0, size)

    return {"step": step, "batch": 64}


def real_largest(machine, cap, waste):
    gpu = machine.gpus[0]
    gpu.fraction = cap / gpu.total_bytes
    batch = 1
    while gpu.allocated + PER_SAMPLE * (batch + 1) * (1 + waste) <= cap:
        batch += 1
    return batch


def test_reserved_peaks_are_each_runs_own_and_the_plan_respects_them(hardware, machine):
    """15% of each step's memory reserved but unusable (a cuDNN LSTM's buffers, ``benchmarks/plan.py``):
    the allocated line alone would promise ~10% more than fits; the reserved line keeps the plan under it."""
    waste = 0.15
    machine.allocate(0, WEIGHTS)
    measured, judged = plan_runs(hardware, machine, wasteful_namespace(machine, waste), "step(batch)")
    # the cache is emptied before each run, so the smaller run's reserved peak is not the larger's
    assert judged.reserved_line is not None
    assert judged.reserved_line.slope_bytes == (1 + waste) * PER_SAMPLE
    card = 16 * GiB
    context = machine.gpus[0].context_bytes
    plan = build_plan(measured.runs, 64, "batch", [], DEFAULT_MARGIN, context, "x", this_card=("16 GiB", card),
                      line=judged.line, reserved_line=judged.reserved_line)
    predicted = plan.this_card.largest_batch
    real = real_largest(machine, card - context, waste)
    assert predicted <= real and predicted >= 0.95 * real
    by_allocated_alone = math.floor((card - context - WEIGHTS) * (1 - DEFAULT_MARGIN) / PER_SAMPLE)
    assert by_allocated_alone > real * (1 + DEFAULT_MARGIN)  # what the reserved line prevents


def test_an_allocator_that_wastes_little_leaves_the_allocated_line_in_charge(hardware, machine):
    machine.allocate(0, WEIGHTS)
    measured, judged = plan_runs(hardware, machine, wasteful_namespace(machine, 0.01), "step(batch)")
    context = machine.gpus[0].context_bytes
    plan = build_plan(measured.runs, 64, "batch", [], DEFAULT_MARGIN, context, "x", this_card=("16 GiB", 16 * GiB),
                      line=judged.line, reserved_line=judged.reserved_line)
    assert plan.this_card.largest_batch == math.floor((16 * GiB - context - WEIGHTS) * (1 - DEFAULT_MARGIN) / PER_SAMPLE)
