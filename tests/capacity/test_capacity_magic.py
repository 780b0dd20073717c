"""``%%cudamem_plan`` in a real InteractiveShell over the fake hardware (jupyter_cudamem/magics/plan.py).

The cells call ``step(batch)``, which allocates ``peak(batch)`` on the fake card and frees it, as a
training step's activations come and go; ``m`` is the fake machine, so tests hold memory "before the
cell" (weights) with ``m.allocate``.
"""

from __future__ import annotations

import contextlib
import logging
import math

import pytest
from IPython.core.error import UsageError

from tests.fakes import FakeAllocator, FakeNvml, GiB, MiB
from jupyter_cudamem import magics
from jupyter_cudamem.capacity.cards import card_table
from jupyter_cudamem.capacity.plan import CALIBRATED_MARGIN, DEFAULT_MARGIN, largest_batch, usable_bytes
from jupyter_cudamem.hardware import Hardware
from jupyter_cudamem.magics.plan import CudaMemPlan
from jupyter_cudamem.growth.line import Line

WEIGHTS = 2 * GiB
PER_SAMPLE = 30 * MiB
CONTEXT = 512 * MiB  # FakeGpu.context_bytes: what NVML sees beyond PyTorch's pools


class Stepper:
    """``step(batch)``: allocate ``per_sample x batch`` (or a chosen function of it) and free it."""

    def __init__(self, machine, peak=lambda b: PER_SAMPLE * b):
        self.machine = machine
        self.peak = peak
        self.calls: list[int] = []
        self.autocast = False

    def __call__(self, batch: int) -> None:
        self.calls.append(batch)
        size = int(self.peak(batch) * (0.5 if self.autocast else 1))
        try:
            self.machine.allocate(0, size)
        except Exception as error:
            raise type("OutOfMemoryError", (RuntimeError,), {})(
                "CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 80.00 GiB"
            ) from error
        self.machine.free(0, size)
        return self

    def backward(self) -> None:
        """Lets a cell read as training (``step(b).backward()``)."""


@pytest.fixture
def plan_shell(shell, machine):
    machine.allocate(0, WEIGHTS)
    stepper = Stepper(machine)
    shell.user_ns.update(step=stepper, MiB=MiB)
    yield shell, machine, stepper
    machine.free(0, machine.gpus[0].allocated)
    shell.run_cell("%config CudaMem.cards = {}")


def usage_error(shell, cell):
    result = shell.run_cell(cell)
    assert isinstance(result.error_in_exec, UsageError), result.error_in_exec
    message = str(result.error_in_exec)
    assert "\n" not in message
    return message


def expected_largest(total_bytes, margin=DEFAULT_MARGIN, per_sample=PER_SAMPLE):
    """The margin is taken from the room above the fixed part: (card - outside - fixed) x (1 - margin)."""
    return math.floor((total_bytes - CONTEXT - WEIGHTS) * (1 - margin) / per_sample)


def test_plan_fits_the_line_and_plans_every_card(plan_shell, capsys):
    shell, machine, stepper = plan_shell
    shell.run_cell("batch_size = 64")
    result = shell.run_cell("%%cudamem_plan -o\nstep(batch_size)\nran_with = batch_size\nbatch_size")
    assert result.success, result.error_in_exec
    plan = shell.user_ns["_"]
    assert plan.line.slope_bytes == pytest.approx(PER_SAMPLE) and plan.line.intercept_bytes == pytest.approx(WEIGHTS)
    assert plan.non_pytorch_bytes == CONTEXT
    for card in card_table():
        assert plan.predicted[card.name] == expected_largest(card.total_bytes)
    assert plan.this_card.largest_batch == expected_largest(80 * GiB)
    # runs: as written (warm-up), half, then as written last; the value and the namespace are the last run's
    assert stepper.calls == [64, 32, 64]
    assert shell.user_ns["batch_size"] == 64 and shell.user_ns["ran_with"] == 64
    out = capsys.readouterr().out
    assert "Out[" in out and "64" in out and "Capacity plan for batch_size = 64" in out
    assert "measured here through NVML" in out and "the first run at batch 64" in out


def test_without_output_option_the_plan_is_shown_and_not_returned(plan_shell, capsys):
    shell, machine, stepper = plan_shell
    result = shell.run_cell("%%cudamem_plan\nran = step(64)")
    assert result.success, result.error_in_exec
    assert result.result is None
    assert "Capacity plan for" in capsys.readouterr().out
    assert not shell.run_cell("%%cudamem_plan -o plan\nstep(64)").success  # -o takes no name: it returns the plan


def test_a_batch_too_big_for_a_card_gets_exact_accumulation(plan_shell):
    shell, machine, stepper = plan_shell
    shell.run_cell("%%cudamem_plan -o --cards T4,H100\nbatch_size = 768\nstep(batch_size)")
    plan = shell.user_ns["_"]
    t4 = plan.card("T4")
    assert not t4.fits and t4.largest_batch == expected_largest(15 * GiB)
    assert t4.micro_batch * t4.steps == 768 and t4.micro_batch <= t4.largest_batch
    assert plan.card("H100 80GB").fits
    assert [c.name for c in plan.cards] == ["T4", "H100 80GB"]
    assert "batch 384 x 2 chunks" in plan.text()  # the cell only runs a model: chunks
    assert shell.user_ns["batch_size"] == 768  # the cell's own number: the last run used it
    shell.run_cell("%%cudamem_plan -o --cards T4\nbatch_size = 768\nstep(batch_size).backward()")
    assert "batch 384 x 2 accumulation steps" in shell.user_ns["_"].text()  # a training cell: accumulation


def test_config_cards_and_margin(plan_shell):
    shell, machine, stepper = plan_shell
    shell.run_cell("%config CudaMem.cards = {'Mine': 12, 'T4': None}")
    shell.run_cell("%%cudamem_plan -o --margin 0.1\nstep(64)")
    plan = shell.user_ns["_"]
    assert "T4" not in plan.predicted and plan.predicted["Mine"] == expected_largest(12 * GiB, 0.1)
    assert plan.margin == 0.1
    assert "not in the table" in usage_error(shell, "%%cudamem_plan --cards T4\nstep(64)")
    assert "--margin" in usage_error(shell, "%%cudamem_plan --margin 1.5\nstep(64)")
    shell.run_cell("%config CudaMem.cards = {'Bad': 'lots'}")  # refused when set (one line), the table kept
    shell.run_cell("%%cudamem_plan -o --margin 0.1\nstep(64)")
    assert "Bad" not in shell.user_ns["_"].predicted and "Mine" in shell.user_ns["_"].predicted


def test_small_overrides_the_second_batch(plan_shell):
    shell, machine, stepper = plan_shell
    shell.run_cell("%%cudamem_plan --small 16 -o\nstep(64)")
    assert stepper.calls == [64, 16, 64]
    assert shell.user_ns["_"].line.slope_bytes == pytest.approx(PER_SAMPLE)
    assert "--small" in usage_error(shell, "%%cudamem_plan --small 64\nstep(64)")


@pytest.mark.parametrize("small", ["0", "-4"])
def test_a_small_below_one_is_refused_before_anything_runs(plan_shell, small):
    """--small is the second batch to measure: whatever the cell holds, 0 or -4 is never one."""
    shell, _, stepper = plan_shell
    for body in ("step(64)", "x = 1"):  # a batch, and none to compare
        message = usage_error(shell, f"%%cudamem_plan --small {small}\n{body}")
        assert "--small" in message and "a whole number from 1" in message, message
    assert stepper.calls == []


def test_a_small_below_one_is_refused_without_a_gpu(ip, machine):
    magics.unload(ip)
    magics.load(ip, Hardware(allocator=FakeAllocator(machine, status="no CUDA device"), nvml=FakeNvml(machine),
                             pid=machine.pid))
    try:
        ip.user_ns["ran"] = []
        message = usage_error(ip, "%%cudamem_plan --small 0\nran.append(1)")
        assert "--small" in message and "a whole number from 1" in message and ip.user_ns["ran"] == []
    finally:
        magics.unload(ip)


def test_no_gpu_runs_the_body_as_a_plain_cell_and_says_what_it_cannot_measure(ip, machine, capsys):
    magics.unload(ip)
    hardware = Hardware(allocator=FakeAllocator(machine, status="no CUDA device (torch.cuda.is_available() is False)"),
                        nvml=FakeNvml(machine, failure="NVML: no driver"), pid=machine.pid)
    magics.load(ip, hardware)
    try:
        ip.user_ns["ran"] = []
        result = ip.run_cell("%%cudamem_plan\nran.append(1)\nlen(ran)", store_history=True)
        assert result.success and ip.user_ns["ran"] == [1]  # as a plain cell: run once
        err = capsys.readouterr().err
        assert "%%cudamem_plan cannot measure here (no CUDA device" in err and "no plan" in err
        assert result.result == 1  # its value is shown as a plain cell's
        failed = ip.run_cell("%%cudamem_plan\n1 / 0", store_history=True)
        assert isinstance(failed.error_in_exec, ZeroDivisionError)  # and fails as one
        usage = usage_error(ip, "%%cudamem_plan --margin 1.5\nran.append(2)")  # options checked first
        assert "--margin" in usage and ip.user_ns["ran"] == [1]
    finally:
        magics.unload(ip)


def test_out_of_memory_at_both_sizes(plan_shell):
    shell, machine, stepper = plan_shell
    machine.gpus[0].fraction = 3 * GiB / machine.gpus[0].total_bytes
    message = usage_error(shell, "batch_size = 256\nstep(batch_size)".join(["%%cudamem_plan\n", ""]))
    assert "both batch 256 and 128" in message


def test_out_of_memory_as_written_plans_from_two_smaller_batches(plan_shell):
    shell, machine, stepper = plan_shell
    machine.gpus[0].fraction = 8 * GiB / machine.gpus[0].total_bytes  # 2 GiB weights + 30 MiB x 200 fits, 256 not
    result = shell.run_cell("%%cudamem_plan -o\nbatch_size = 256\nstep(batch_size)")
    assert result.success, result.error_in_exec
    plan = shell.user_ns["_"]
    assert stepper.calls == [256, 128, 64]
    assert plan.line.slope_bytes == pytest.approx(PER_SAMPLE)
    assert any("ran out of GPU memory here" in note for note in plan.notes)


def test_peak_growing_faster_than_the_batch_is_refused(plan_shell):
    shell, machine, stepper = plan_shell
    stepper.peak = lambda b: 4 * MiB * b + 0.5 * MiB * b * b  # a batch x batch matrix
    assert "grows faster than the batch" in usage_error(shell, "%%cudamem_plan\nstep(128)")


def test_a_cell_that_is_not_repeatable_is_refused(plan_shell):
    shell, machine, stepper = plan_shell
    grow = iter(range(1, 100))
    stepper.peak = lambda b: PER_SAMPLE * b * next(grow)
    assert "not repeatable" in usage_error(shell, "%%cudamem_plan\nstep(64)")


def test_a_cell_that_keeps_memory_is_refused(plan_shell):
    shell, machine, stepper = plan_shell
    shell.user_ns["keep"] = lambda: machine.allocate(0, 300 * MiB)
    assert "not repeatable" in usage_error(shell, "%%cudamem_plan\nstep(64)\nkeep()")


def test_first_run_that_creates_state_is_a_warm_up(plan_shell):
    shell, machine, stepper = plan_shell
    shell.user_ns["state"] = []
    shell.user_ns["make_state"] = lambda: (machine.allocate(0, GiB), shell.user_ns["state"].append(1)) if not shell.user_ns["state"] else None
    result = shell.run_cell("%%cudamem_plan -o\nstep(64)\nmake_state()")
    assert result.success, result.error_in_exec
    plan = shell.user_ns["_"]
    assert plan.line.intercept_bytes == pytest.approx(WEIGHTS + GiB)  # the optimizer-like state is part of the fixed part
    assert any("warm-up" in note for note in plan.notes)


def test_the_cells_own_error_behaves_as_a_plain_cells(plan_shell):
    shell, machine, stepper = plan_shell
    shell.run_cell("batch_size = 64")
    result = shell.run_cell("%%cudamem_plan\nstep(batch_size)\nraise ValueError('mine')")
    assert isinstance(result.error_in_exec, ValueError) and str(result.error_in_exec) == "mine"
    assert shell.user_ns["batch_size"] == 64
    # an error only at the smaller batch: the batch is put back all the same
    result = shell.run_cell("%%cudamem_plan\nstep(batch_size)\nassert batch_size == 64, 'only 64'")
    assert isinstance(result.error_in_exec, AssertionError)
    assert shell.user_ns["batch_size"] == 64


@pytest.mark.parametrize(
    ("body", "error", "shown"),
    [
        ("step(batch_size)\n1 / 0", ZeroDivisionError, "ZeroDivisionError"),
        ("x = (", SyntaxError, "SyntaxError"),
        ("step(batch_size)\nraise KeyboardInterrupt", KeyboardInterrupt, "KeyboardInterrupt"),
    ],
)
def test_the_cells_own_error_shows_the_plain_cells_traceback(plan_shell, capsys, body, error, shown):
    """As the same cell without the magic: its traceback, none of our frames, the cell marked failed."""
    import re

    shell, machine, stepper = plan_shell
    shell.run_cell("batch_size = 64")
    capsys.readouterr()
    plain = shell.run_cell(body, store_history=True)
    plain_out = capsys.readouterr()
    result = shell.run_cell("%%cudamem_plan\n" + body, store_history=True)
    out = capsys.readouterr()
    text = re.sub(r"\x1b\[[0-9;]*m", "", out.out + out.err)
    assert isinstance(plain.error_in_exec or plain.error_before_exec, error)
    assert isinstance(result.error_in_exec, error)
    assert not result.success and shown in text
    assert "jupyter_cudamem" not in text and "capacity" not in text and "Runner" not in text
    # The same traceback lines as the plain cell (but the cell's number).
    plain_text = re.sub(r"\x1b\[[0-9;]*m", "", plain_out.out + plain_out.err)
    assert len(text.strip().splitlines()) == len(plain_text.strip().splitlines())


@pytest.mark.parametrize("raised", ("ExceptionGroup('g', [ValueError(1)])", "IndentationError('i')"))
def test_an_error_printed_from_its_own_traceback_shows_no_frame_of_ours(plan_shell, capsys, raised):
    """Exception groups and SyntaxErrors are printed from the error's ``__traceback__``, which holds every
    frame it passed through on its way up the plan's runs (a plain cell's shows IPython's own frame too)."""
    shell, machine, stepper = plan_shell
    shell.run_cell("batch_size = 64")
    capsys.readouterr()
    result = shell.run_cell(f"%%cudamem_plan\nstep(batch_size)\nraise {raised}", store_history=True)
    out = capsys.readouterr()
    assert type(result.error_in_exec).__name__ == raised.split("(")[0] and not result.success
    assert "jupyter_cudamem" not in out.out + out.err and raised.split("(")[0] in out.out + out.err


def test_a_cell_with_no_batch_is_measured_once(plan_shell, capsys):
    shell, machine, stepper = plan_shell
    shell.user_ns["calls"] = []
    result = shell.run_cell("%%cudamem_plan -o\ncalls.append(1)\nm.allocate(0, 3 * GiB); m.free(0, 3 * GiB)")
    assert result.success, result.error_in_exec
    plan = shell.user_ns["_"]
    assert shell.user_ns["calls"] == [1] and plan.line is None
    assert plan.fixed_bytes == WEIGHTS + 3 * GiB
    assert plan.card("T4").fits and "fixed-size" in capsys.readouterr().out


def test_extra_runs_are_quiet(plan_shell, capsys):
    shell, machine, stepper = plan_shell
    shell.run_cell("%%cudamem_plan\nstep(64)\nprint('hello from the cell')")
    assert capsys.readouterr().out.count("hello from the cell") == 1


def test_autocast_run_says_what_it_buys(plan_shell):
    shell, machine, stepper = plan_shell

    class FakeTorch:
        float16 = bfloat16 = "half"

        @staticmethod
        @contextlib.contextmanager
        def autocast(device, dtype=None):
            stepper.autocast = True
            try:
                yield
            finally:
                stepper.autocast = False

    shell.user_ns["torch"] = FakeTorch
    result = shell.run_cell("%%cudamem_plan --autocast -o\nstep(64)")
    assert result.success, result.error_in_exec
    plan = shell.user_ns["_"]
    assert plan.autocast_line.slope_bytes == pytest.approx(PER_SAMPLE / 2)
    t4 = plan.card("T4")
    # Half the bytes a sample: twice the float32 column's samples in the same room.
    assert t4.largest_autocast_batch == 2 * expected_largest(15 * GiB) == 818
    assert "under autocast" in plan.text() and stepper.calls == [64, 32, 64, 64]


def test_history_measurement_of_the_same_cell_is_compared(plan_shell):
    shell, machine, stepper = plan_shell
    shell.run_cell("%%cudamem -q\nstep(64)")
    shell.run_cell("%%cudamem_plan -o\nstep(64)")
    labels = [a.label for a in shell.user_ns["_"].agreements]
    assert any(label.startswith("%%cudamem") for label in labels)
    agreement = shell.user_ns["_"].agreements[-1]
    assert abs(agreement.relative) < 0.01


def test_plan_html_carries_the_figure(plan_shell):
    shell, machine, stepper = plan_shell
    shell.run_cell("%%cudamem_plan -o\nstep(64)")
    html = shell.user_ns["_"]._repr_html_()
    assert "<table" in html and "data:image/png;base64," in html
    figure = shell.user_ns["_"].figure()
    assert figure.axes[0].get_yscale() == "log"
    # Each card's dot sits at the batch its table row gives, on its usable level (it once sat where the
    # allocated line alone crossed the level: 1,050 against the table's 529).
    plan = shell.user_ns["_"]
    dots = {(round(line.get_xdata()[0]), round(line.get_ydata()[0] * GiB)) for line in figure.axes[0].get_lines()
            if len(line.get_xdata()) == 1 and line.get_markersize() == 5}
    cards = ([plan.this_card] if plan.this_card is not None else []) + list(plan.cards)
    expected = {(card.largest_batch, card.usable_bytes) for card in cards if card.largest_batch}
    assert dots and {batch for batch, _ in dots} == {batch for batch, _ in expected}


def test_memory_outside_pytorch_is_measured_not_assumed(plan_shell):
    shell, machine, stepper = plan_shell
    machine.gpus[0].outside_bytes = 700 * MiB  # cuBLAS/cuDNN workspaces, CuPy...
    shell.run_cell("%%cudamem_plan -o --cards T4\nstep(64)")
    plan = shell.user_ns["_"]
    assert plan.non_pytorch_bytes == CONTEXT + 700 * MiB
    assert plan.card("T4").largest_batch == largest_batch(
        Line(PER_SAMPLE, WEIGHTS), usable_bytes(15 * GiB, CONTEXT + 700 * MiB), DEFAULT_MARGIN)
    assert plan.card("T4").largest_batch == expected_largest(15 * GiB - 700 * MiB)
    machine.gpus[0].outside_bytes = 0


def test_without_process_listing_the_whole_card_counts_and_says_so(ip, machine):
    magics.unload(ip)
    machine.allocate(0, WEIGHTS)
    machine.gpus[0].other_process_bytes = GiB
    magics.load(ip, Hardware(allocator=FakeAllocator(machine), nvml=FakeNvml(machine, processes_visible=False),
                             pid=machine.pid))
    try:
        ip.user_ns.update(step=Stepper(machine))
        assert ip.run_cell("%%cudamem_plan -o\nstep(64)").success
        plan = ip.user_ns["_"]
        assert plan.non_pytorch_bytes == CONTEXT + GiB and "other processes on the card count too" in plan.text()
    finally:
        magics.unload(ip)


def test_without_nvml_the_plan_says_the_context_was_not_measured(ip, machine):
    magics.unload(ip)
    machine.allocate(0, WEIGHTS)
    magics.load(ip, Hardware(allocator=FakeAllocator(machine), nvml=FakeNvml(machine, failure="NVML: no library"),
                             pid=machine.pid))
    try:
        ip.user_ns.update(step=Stepper(machine))
        assert ip.run_cell("%%cudamem_plan -o\nstep(64)").success
        plan = ip.user_ns["_"]
        assert plan.non_pytorch_bytes == 0 and "NOT measured (NVML: no library)" in plan.text()
    finally:
        magics.unload(ip)


def test_this_card_under_a_cap_is_what_the_cap_leaves(plan_shell):
    shell, machine, stepper = plan_shell
    machine.gpus[0].fraction = 10 * GiB / machine.gpus[0].total_bytes
    shell.run_cell("%%cudamem_plan -o --cards T4\nbatch_size = 512\nstep(batch_size)")
    here = shell.user_ns["_"].this_card
    assert "capped at 10.0 GiB" in here.name
    assert here.usable_bytes == 10 * GiB  # the margin is taken from the room above the fixed part
    assert not here.fits and here.largest_batch == math.floor((10 * GiB - WEIGHTS) * (1 - DEFAULT_MARGIN) / PER_SAMPLE)


def test_state_created_by_the_smaller_run_after_an_oom_is_a_warm_up(plan_shell):
    shell, machine, stepper = plan_shell
    machine.gpus[0].fraction = 12 * GiB / machine.gpus[0].total_bytes
    shell.user_ns["state"] = []
    shell.user_ns["make_state"] = lambda: (machine.allocate(0, GiB), shell.user_ns["state"].append(1)) if not shell.user_ns["state"] else None
    result = shell.run_cell("%%cudamem_plan -o\nbatch_size = 512\nstep(batch_size)\nmake_state()")
    assert result.success, result.error_in_exec
    plan = shell.user_ns["_"]
    assert stepper.calls == [512, 256, 128, 256]
    assert [r.label for r in plan.runs] == ["as written", "smaller (warm-up)", "smaller still", "smaller"]
    assert plan.line.intercept_bytes == pytest.approx(WEIGHTS + GiB)
    assert plan.line.slope_bytes == pytest.approx(PER_SAMPLE)


def test_a_cell_that_uses_no_gpu_memory_is_one_line(plan_shell):
    shell, machine, stepper = plan_shell
    assert "used no GPU memory" in usage_error(shell, "%%cudamem_plan\nbatch_size = 64\nx = [0] * batch_size")


def test_a_second_batch_larger_than_the_first_that_does_not_fit(plan_shell):
    shell, machine, stepper = plan_shell
    machine.gpus[0].fraction = 8 * GiB / machine.gpus[0].total_bytes
    message = usage_error(shell, "%%cudamem_plan --small 512\nstep(64)")
    assert "at batch 512 but not at 64" in message and "--small" in message


def test_calibrate_finds_the_largest_batch_here_and_scales_every_card(plan_shell, capsys):
    """``--calibrate``: the cell runs at batches that fill this card until the largest that fits is
    bracketed, before its last run at the batch as written; here the fake allocator hands out exactly
    what is asked, so the ratio is 1 and every card's batch is the allocated line's."""
    shell, machine, stepper = plan_shell
    shell.run_cell("batch_size = 64")
    result = shell.run_cell("%%cudamem_plan --calibrate -o\nstep(batch_size)")
    assert result.success, result.error_in_exec
    plan = shell.user_ns["_"]
    # calibrated at the smallest card of the table, a T4, played by capping the fake card at what a T4
    # leaves PyTorch; the cap is put back
    t4 = usable_bytes(15 * GiB, CONTEXT)
    truth = (t4 - WEIGHTS) // PER_SAMPLE
    assert plan.calibration is not None and plan.calibration.card == "T4" and machine.gpus[0].fraction == 1.0
    assert plan.calibration.fitted <= truth
    assert plan.calibration.failed is not None and plan.calibration.failed > truth
    assert stepper.calls[:2] == [64, 32] and stepper.calls[-1] == 64 and len(stepper.calls) > 4
    assert shell.user_ns["batch_size"] == 64
    assert plan.calibration_ratio == pytest.approx(t4 / (WEIGHTS + PER_SAMPLE * plan.calibration.fitted))
    assert "calibrated: batch" in capsys.readouterr().out and "a T4's memory" in plan.text()
    # every card: the line scaled by the ratio, with the calibrated plan's margin
    from jupyter_cudamem.capacity.plan import CALIBRATED_MARGIN

    k = plan.calibration_ratio
    assert plan.margin == CALIBRATED_MARGIN
    labels = [line.get_label() for line in plan.figure().axes[0].get_lines()]
    assert any("calibrated" in label for label in labels)  # the line the cards are planned on is drawn
    assert plan.card("T4").largest_batch == math.floor((t4 - WEIGHTS * k) * (1 - CALIBRATED_MARGIN) / (PER_SAMPLE * k) + 1e-9)
    shell.run_cell("%%cudamem_plan --calibrate --margin 0.1 -o\nstep(batch_size)")
    assert shell.user_ns["_"].margin == 0.1  # --margin still decides


def test_calibrate_without_a_batch_says_so(plan_shell):
    shell, machine, stepper = plan_shell
    shell.user_ns["calls"] = []
    shell.run_cell("%%cudamem_plan --calibrate -o\ncalls.append(1)\nm.allocate(0, 3 * GiB); m.free(0, 3 * GiB)")
    plan = shell.user_ns["_"]
    assert shell.user_ns["calls"] == [1]
    assert plan.calibration_ratio is None and any("--calibrate needs a batch" in note for note in plan.notes)


def test_calibrate_keeps_a_cap_the_user_set(plan_shell):
    """A per-process cap set before the plan (here, what a T4 leaves) is this card for the plan; the search
    caps no further where no card is smaller, and the user's cap is there after."""
    shell, machine, stepper = plan_shell
    machine.gpus[0].fraction = 0.5
    shell.run_cell("batch_size = 64")
    result = shell.run_cell("%%cudamem_plan --calibrate --cards H100 -o\nstep(batch_size)")
    assert result.success, result.error_in_exec
    plan = shell.user_ns["_"]
    assert machine.gpus[0].fraction == 0.5
    assert plan.calibration is not None and plan.calibration.fitted <= (40 * GiB - WEIGHTS) // PER_SAMPLE
    machine.gpus[0].fraction = 1.0


def test_a_calibrated_margin_out_of_range_is_refused_when_set(plan_shell, caplog):
    # It was accepted and then refused by the next --calibrate plan, which named a flag the user never typed.
    shell, machine, stepper = plan_shell
    with caplog.at_level(logging.ERROR):
        shell.run_cell("%config CudaMemPlan.calibrated_margin = 1.5")
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(messages) == 1 and messages[0].startswith("CudaMemPlan.calibrated_margin takes a fraction"), messages
    assert magics.loaded(shell).get(CudaMemPlan).calibrated_margin == CALIBRATED_MARGIN and stepper.calls == []


def test_the_plans_runs_leave_the_model_and_lists_as_one_run_of_the_cell(plan_shell):
    """The plan runs the cell four times; the model, its optimizer and the list the cell appends to end as
    the first run at the batch as written left them, as one plain run of the cell would."""
    torch = pytest.importorskip("torch")
    import copy

    shell, _, _ = plan_shell
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    shell.user_ns.update(torch=torch, model=model, optimizer=optimizer)
    cell = ("step(batch_size)\nloss = model(torch.ones(batch_size, 4)).pow(2).mean()\nloss.backward()\n"
            "optimizer.step()\noptimizer.zero_grad()\nlosses.append(batch_size)\n")
    plain_model, plain_optimizer = copy.deepcopy((model, optimizer))
    exec(cell, {"torch": torch, "model": plain_model, "optimizer": plain_optimizer, "losses": [],
                "batch_size": 64, "step": lambda batch: None})
    shell.run_cell("batch_size = 64\nlosses = []")
    losses = shell.user_ns["losses"]
    try:
        result = shell.run_cell("%%cudamem_plan -o\n" + cell)
        bound = shell.user_ns.get("losses")
    finally:  # the shell is shared: a later test's breakdown would count this model's tensors
        for name in ("model", "optimizer", "loss", "losses", "torch"):
            shell.user_ns.pop(name, None)
    assert result.success, result.error_in_exec
    assert len([run for run in result.result.runs]) >= 3  # the cell ran more than once
    assert losses == [64] and bound is losses
    assert torch.equal(model.weight, plain_model.weight) and torch.equal(model.bias, plain_model.bias)
    assert optimizer.state_dict()["state"][0]["step"].item() == 1.0
    assert any("put back after the plan's runs" in note and "losses" in note and "model" in note
               for note in result.result.notes), result.result.notes


class _GraphPoolStepper(Stepper):
    """A reduce-overhead model's step: each run leaves its CUDA graph's pool, 2 MiB per sample of its batch,
    which only a reset of the graph trees gives back (``FakeAllocator.release_graph_pools``)."""

    def __init__(self, machine, allocator):
        super().__init__(machine)
        self.allocator = allocator
        self.pool_at_start: list[int] = []

    def __call__(self, batch):
        self.pool_at_start.append(self.allocator.graph_pool_bytes)
        super().__call__(batch)
        self.allocator.graph_pool_bytes = 2 * MiB * batch
        return self


def test_cuda_graph_pools_are_reset_before_each_run_after_the_first_and_named_once(plan_shell, hardware):
    shell, machine, _ = plan_shell
    allocator = hardware.allocator
    stepper = _GraphPoolStepper(machine, allocator)
    shell.user_ns.update(step=stepper, batch_size=64)
    allocator.graph_pool_bytes = 2 * MiB * 64  # the user's own run of the cell, before the plan
    result = shell.run_cell("%%cudamem_plan -o\nstep(batch_size)")
    assert result.success, result.error_in_exec
    plan = result.result
    # The first run finds the user's pools (the device is not known before it); every later run starts with none.
    assert stepper.calls == [64, 32, 64]
    assert stepper.pool_at_start == [2 * MiB * 64, 0, 0]
    assert allocator.calls.count("release_graph_pools:0") == 2
    notes = [note for note in plan.notes if note.startswith("torch.compile's CUDA graphs")]
    assert notes == ["torch.compile's CUDA graphs (mode=\"reduce-overhead\") held up to 128.00 MiB in memory pools no "
                     "other allocation uses: reset (torch.compiler.reset()) before each run, which compiles again"]
    assert allocator.graph_pool_bytes == 2 * MiB * 64  # the last run's, as one plain run of the cell leaves


def test_without_cuda_graph_pools_the_plan_says_nothing_of_them(plan_shell):
    shell, _, _ = plan_shell
    result = shell.run_cell("%%cudamem_plan -o\nstep(64)")
    assert result.success, result.error_in_exec
    assert not any("CUDA graphs" in note for note in result.result.notes)


def test_a_batch_of_one_is_a_batch(plan_shell):
    """``batch_size = 1`` in an earlier cell: the plan finds it, measures it at 1 and at 2 (a batch of 1 has none
    smaller) and fits the line through both: 2 GiB of weights and 30 MiB a sample."""
    shell, machine, stepper = plan_shell
    shell.run_cell("batch_size = 1", store_history=True)
    result = shell.run_cell("%%cudamem_plan -o\nstep(batch_size)", store_history=True)
    assert result.success, result.error_in_exec
    plan = result.result
    assert plan.batch == 1 and sorted(stepper.calls) == [1, 1, 2]  # the last run is the batch as written
    assert plan.line.slope_bytes == PER_SAMPLE and plan.line.intercept_bytes == WEIGHTS
    assert shell.user_ns["batch_size"] == 1
