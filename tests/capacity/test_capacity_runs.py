"""The plan's runs (jupyter_cudamem/capacity/runs.py) over the fake hardware: each run starts clean.

- A cell that binds the tensors it creates (``x = ...``, ``preds = ...``) must not carry the previous
  run's tensors into the next run: they are set aside before each run (``oomfix.leftovers``).
- Each run's reserved peak is its own (the cache is emptied before it), and a card is limited by what
  the allocator reserves: the plan follows the reserved line where it needs more than the margin.
"""

from __future__ import annotations

import math

import pytest

from tests.fakes import FakeMover, FakeTensor, GiB, MiB
from jupyter_cudamem.cell.read import read_cell
from jupyter_cudamem.capacity.plan import DEFAULT_MARGIN, build_plan
from jupyter_cudamem.errors import CudaMemError
from jupyter_cudamem.capacity.runs import Runner, judge, measure_runs
from jupyter_cudamem.measure import Meter
from jupyter_cudamem.reruns.set_aside import set_aside

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
                    set_aside=(lambda s: set_aside(namespace, read_cell(s).rebinds, FakeMover(machine))) if mover else None)
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
                    set_aside=lambda s: set_aside(namespace, read_cell(s).rebinds, FakeMover(machine)))

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
    assert "an estimate from two runs" in plan.text() and "--calibrate measures" in plan.text()


def test_an_allocator_that_wastes_little_leaves_the_allocated_line_in_charge(hardware, machine):
    machine.allocate(0, WEIGHTS)
    measured, judged = plan_runs(hardware, machine, wasteful_namespace(machine, 0.01), "step(batch)")
    context = machine.gpus[0].context_bytes
    plan = build_plan(measured.runs, 64, "batch", [], DEFAULT_MARGIN, context, "x", this_card=("16 GiB", 16 * GiB),
                      line=judged.line, reserved_line=judged.reserved_line)
    assert plan.this_card.largest_batch == math.floor((16 * GiB - context - WEIGHTS) * (1 - DEFAULT_MARGIN) / PER_SAMPLE)
    assert "an estimate from two runs" in plan.text()  # whichever line decides


# -- --calibrate: the largest batch that fits here, and the ratio it gives the line ---------------------
def calibrated_runs(hardware, machine, namespace, usable, capped=False):
    """The plan's runs with a calibration at ``usable`` bytes: this card's own (uncapped) or, with
    ``capped``, a smaller card played by capping the fake card as the magic does."""
    import contextlib

    from jupyter_cudamem.capacity.runs import CalibrationScale

    gpu = machine.gpus[0]

    @contextlib.contextmanager
    def cap():
        before = gpu.fraction
        gpu.fraction = usable / gpu.total_bytes
        try:
            yield
        finally:
            gpu.fraction = before

    runner = Runner(Meter(hardware, reset_peak=True), lambda s: exec(s, namespace), lambda e: "out of memory" in str(e),
                    release=hardware.allocator.empty_cache)
    scale = CalibrationScale(usable, "smaller card" if capped else "this card", cap if capped else None)
    measured = measure_runs(runner, "step(batch)", 64, NamespaceBatch(namespace, "step(batch)", 64),
                            calibrate_at=lambda: scale)
    return measured, judge(measured, 64)


def test_calibration_finds_the_largest_batch_here_and_the_plan_follows_a_cards_cap(hardware, machine):
    """15% of each step reserved but unusable: the calibration sees it where the cell fills this card,
    and the plan for a 16 GiB card lands within 5% of what really fits there, not above."""
    from jupyter_cudamem.capacity.runs import AGAIN, CALIBRATION, CALIBRATION_RESOLUTION, FINAL

    waste = 0.15
    machine.allocate(0, WEIGHTS)
    namespace = wasteful_namespace(machine, waste)
    here = machine.gpus[0].total_bytes
    measured, judged = calibrated_runs(hardware, machine, namespace, here)
    found = measured.calibration
    assert found is not None and found.failed is not None
    truth_here = real_largest(machine, here, waste)
    machine.gpus[0].fraction = 1.0
    assert found.fitted <= truth_here < found.failed
    assert found.failed - found.fitted <= max(1, int(found.fitted * CALIBRATION_RESOLUTION))
    assert found.runs <= 12 and found.ratio(judged.line) == pytest.approx(1 + waste, rel=0.01)
    # the calibration ran before the last run: the namespace ends as after a run at the batch as written
    labels = [run.label for run in measured.runs]
    assert labels[-1] == FINAL and labels.index(AGAIN) < labels.index(CALIBRATION) and namespace["batch"] == 64
    card = 16 * GiB
    context = machine.gpus[0].context_bytes
    plan = build_plan(measured.runs, 64, "batch", [], DEFAULT_MARGIN, context, "x", this_card=("16 GiB", card),
                      line=judged.line, calibration=found)
    real = real_largest(machine, card - context, waste)
    predicted = plan.this_card.largest_batch
    assert 0.95 * real <= predicted <= real
    assert plan.calibration is not None and plan.calibration.fitted == found.fitted and "calibrated" in plan.text()
    assert "an estimate from two runs" not in plan.text()


def test_calibration_sees_a_workspace_that_a_cap_does_without(hardware, machine):
    """A library that takes a workspace half the size of the activations when there is room, and does
    without it under a cap (cuDNN's convolutions in inference): the uncapped line is a third too steep,
    so without calibration the plan is far below what fits; with it, within 5% and not above."""
    machine.allocate(0, WEIGHTS)
    gpu = machine.gpus[0]

    def step(batch):
        size = PER_SAMPLE * batch
        machine.allocate(0, size)
        workspace = size // 2 if gpu.allocated + size // 2 <= gpu.fraction * gpu.total_bytes else 0
        if workspace:
            machine.allocate(0, workspace)
        machine.free(0, size + workspace)

    namespace = {"step": step, "batch": 64}
    measured, judged = calibrated_runs(hardware, machine, namespace, gpu.total_bytes)
    assert judged.line.slope_bytes == pytest.approx(1.5 * PER_SAMPLE)
    found = measured.calibration
    ratio = found.ratio(judged.line)
    assert ratio < 0.7
    card, context = 16 * GiB, gpu.context_bytes
    real = real_largest(machine, card - context, 0.0)
    gpu.fraction = 1.0
    plain = build_plan(measured.runs, 64, "batch", [], DEFAULT_MARGIN, context, "x", this_card=("16 GiB", card),
                       line=judged.line, reserved_line=judged.reserved_line)
    calibrated = build_plan(measured.runs, 64, "batch", [], DEFAULT_MARGIN, context, "x", this_card=("16 GiB", card),
                            line=judged.line, calibration=found)
    assert plain.this_card.largest_batch < 0.7 * real
    assert 0.95 * real <= calibrated.this_card.largest_batch <= real * (1 + DEFAULT_MARGIN)


def test_a_cell_error_at_a_large_batch_ends_the_calibration(hardware, machine):
    """A cell that raises its own error at a batch only the calibration tries: no calibration, said in
    one note, and the plan's own runs stand (the last run is at the batch as written)."""
    machine.allocate(0, WEIGHTS)

    def step(batch):
        if batch > 1000:
            raise ValueError("index out of range for the embedding")
        machine.allocate(0, PER_SAMPLE * batch)
        machine.free(0, PER_SAMPLE * batch)

    namespace = {"step": step, "batch": 64}
    measured, judged = calibrated_runs(hardware, machine, namespace, machine.gpus[0].total_bytes)
    assert measured.calibration is None and judged.line is not None
    assert any("ValueError" in note and "not calibrated" in note for note in measured.notes)
    assert measured.runs[-1].batch == 64 and namespace["batch"] == 64


def test_a_search_that_cannot_bracket_in_its_runs_says_so(hardware, machine):
    """A card far larger than the line's guess (its memory misread): the search stops after its runs
    with what fitted, and the plan says it stopped early."""
    from jupyter_cudamem.capacity.runs import CALIBRATION_RUNS

    machine.allocate(0, WEIGHTS)
    namespace = wasteful_namespace(machine, 0.0)
    measured, _ = calibrated_runs(hardware, machine, namespace, 2 * GiB + 64 * PER_SAMPLE)  # guess: 64
    found = measured.calibration
    assert found is not None and found.failed is None and found.runs == CALIBRATION_RUNS
    assert any("stopped early" in note for note in measured.notes)


def test_calibration_at_a_smaller_card_plays_it_with_a_cap_and_puts_the_cap_back(hardware, machine):
    """What a cap costs beyond the allocated peak shrinks as the card grows (a waste that is a fixed
    amount per step, here 1 GiB, is 1/16 of a 16 GiB card and 1/80 of this one): calibrated at the
    smallest card, the plan is exact there and cautious on larger ones; calibrated at this card, it would
    promise the small card too much."""
    gpu = machine.gpus[0]
    machine.allocate(0, WEIGHTS)

    def step(batch):
        size = PER_SAMPLE * batch
        machine.allocate(0, size, slack=GiB)
        machine.free(0, size)

    namespace = {"step": step, "batch": 64}
    context = gpu.context_bytes
    small = 16 * GiB - context
    measured, judged = calibrated_runs(hardware, machine, namespace, small, capped=True)
    assert gpu.fraction == 1.0  # the cap is put back
    found = measured.calibration
    real_small = (small - WEIGHTS - GiB) // PER_SAMPLE
    assert found.fitted <= real_small < found.failed and found.card == "smaller card"
    for card, within in ((16 * GiB, 0.95), (40 * GiB, 0.9)):  # exact but for the margin, then cautious
        plan = build_plan(measured.runs, 64, "batch", [], DEFAULT_MARGIN, context, "x", this_card=("card", card),
                          line=judged.line, calibration=found)
        real = (card - context - WEIGHTS - GiB) // PER_SAMPLE
        assert within * real <= plan.this_card.largest_batch <= real
    here, _ = calibrated_runs(hardware, machine, namespace, gpu.total_bytes)
    at_this_card = build_plan(here.runs, 64, "batch", [], 0.0, context, "x", this_card=("card", 16 * GiB),
                              line=judged.line, calibration=here.calibration)
    assert at_this_card.this_card.largest_batch > real_small  # what calibrating at the largest card would promise


def test_what_a_calibration_run_leaves_does_not_move_the_lines_points(hardware, machine):
    """A library that keeps a buffer the first time it meets a large batch (here 64 MiB, from batch 1000 on):
    the calibration meets it, the line's points do not (they are measured before it), so the plan is made,
    not refused as a cell that keeps memory; the cell's last run is at its own batch."""
    from jupyter_cudamem.capacity.runs import FINAL

    machine.allocate(0, WEIGHTS)
    kept: list[int] = []

    def step(batch):
        if batch >= 1000 and not kept:
            machine.allocate(0, 64 * MiB)
            kept.append(64 * MiB)
        size = PER_SAMPLE * batch
        machine.allocate(0, size)
        machine.free(0, size)

    namespace = {"step": step, "batch": 64}
    measured, judged = calibrated_runs(hardware, machine, namespace, machine.gpus[0].total_bytes)
    assert kept and measured.calibration is not None and judged.line.slope_bytes == pytest.approx(PER_SAMPLE)
    assert measured.runs[-1].label == FINAL and measured.runs[-1].batch == 64
