"""The plan's largest batch from the allocator's replay of its two recorded runs (``plan.replayed_largest``):
the memory model %oomfix's search uses, with workspaces a library gives back at once taken as optional."""

from __future__ import annotations

import contextlib

import pytest

from jupyter_cudamem.cell.read import read_cell
from jupyter_cudamem.capacity.cards import Card
from jupyter_cudamem.errors import CudaMemError
from jupyter_cudamem.capacity.plan import DEFAULT_MARGIN, Run, build_plan
from jupyter_cudamem.capacity.runs import (AGAIN, AS_WRITTEN, AUTOCAST, FINAL, SMALLER, WORKSPACES, Measured, Runner, judge,
                                           measure_runs, probe_workspaces)
from jupyter_cudamem.growth.replay import ALLOC, FREE, TRY, optional_workspaces
from jupyter_cudamem.growth.line import line_through
from jupyter_cudamem.measure import Meter
from jupyter_cudamem.growth.replay import RecordedRun
from jupyter_cudamem.reruns.set_aside import set_aside
from tests.fakes import FakeMover, FakeTensor, MiB

CARD = Card("a 100 MiB card", 100 / 1024)


def step_events(batch: int) -> tuple:
    """An activation of a MiB a sample kept across a library call whose workspace, twice as large, is
    given back at once."""
    return ((ALLOC, 0, batch * MiB, 0), (ALLOC, 1, 2 * batch * MiB, 0), (FREE, 1, 0, 0), (FREE, 0, 0, 0))


def recorded_run(label: str, batch: int) -> Run:
    peak = 3 * batch * MiB
    return Run(label, batch, peak, 0, 0, peak_reserved_bytes=peak, recorded=RecordedRun((), step_events(batch)))


def plan_of(runs: list[Run], margin: float = DEFAULT_MARGIN, replay: bool = True, optional: bool = True):
    line = line_through([(r.batch, r.peak_bytes) for r in runs])  # type: ignore[misc]
    return build_plan(runs, 16, "batch", [CARD], margin, 0, "none here", line=line,
                      replay_runs=(runs[0], runs[1]) if replay else None, workspaces_optional=optional)


def test_a_workspace_given_back_at_once_becomes_a_request_the_run_survives_being_refused():
    events = [(ALLOC, 0, 5, 0), (ALLOC, 1, 7, 0), (FREE, 1, 0, 0), (ALLOC, 2, 3, 0), (FREE, 0, 0, 0), (FREE, 2, 0, 0)]
    assert optional_workspaces(events) == [(ALLOC, 0, 5, 0), (TRY, 1, 7, 0), (ALLOC, 2, 3, 0), (FREE, 0, 0, 0),
                                           (FREE, 2, 0, 0)]


def test_the_replay_decides_where_the_runs_were_recorded_and_the_workspace_is_not_needed():
    runs = [recorded_run(SMALLER, 8), recorded_run(AGAIN, 16)]
    replayed = plan_of(runs)
    by_line = plan_of(runs, replay=False)
    assert replayed.replayed and not by_line.replayed
    # The allocated peak counts the workspace (3 MiB a sample): 100 MiB x 0.96 / 3 MiB = 32 with the margin.
    assert by_line.card(CARD.name).largest_batch == 32
    # The replay needs the activation only (1 MiB a sample, 2% larger): 98 x 1.02 MiB fits in 100 MiB, 99 not.
    assert replayed.card(CARD.name).largest_batch == 98
    assert "replayed through PyTorch's caching allocator" in replayed.text() and "do without" in replayed.text()


def test_workspaces_the_cell_did_not_do_without_are_replayed_as_needed():
    needed = plan_of([recorded_run(SMALLER, 8), recorded_run(AGAIN, 16)], optional=False)
    # 32 x 1.02 MiB and 64 x 1.02 MiB take segments of 34 and 66 MiB: 100 MiB; 33 needs 102.
    assert needed.replayed and not needed.workspaces_optional
    assert needed.card(CARD.name).largest_batch == 32
    assert "taken as needed" in needed.text()


def test_a_margin_beyond_the_default_is_taken_on_the_replayed_requests_too():
    runs = [recorded_run(SMALLER, 8), recorded_run(AGAIN, 16)]
    wider = plan_of(runs, margin=DEFAULT_MARGIN + 0.2)  # each request 22% larger: 81 x 1.22 MiB fits, 82 not
    assert wider.card(CARD.name).largest_batch == 81


class FakeRecorder:
    """Records what the fake machine allocates as one run's events, once it is told the device."""

    def __init__(self, machine):
        self.machine = machine
        self.devices: list[int] = []

    def start(self, device):
        self.devices.append(device)
        return ()

    def stop(self, start, device, failed):
        allocated = self.machine.gpus[device].allocated
        return RecordedRun(start, ((ALLOC, 0, allocated, 0),))


def test_the_runner_records_each_run_once_the_device_is_known_and_judge_pairs_the_lines_runs(hardware, machine):
    namespace = {"make": lambda batch: FakeTensor(20 * MiB * batch, machine=machine), "batch": 64}

    class Batch:
        def apply(self, batch):
            namespace["batch"] = batch
            return "x = make(batch)\n"

        def restore(self):
            namespace["batch"] = 64

    recorder = FakeRecorder(machine)
    runner = Runner(Meter(hardware, reset_peak=True), lambda s: exec(s, namespace), lambda e: False,
                    release=hardware.allocator.empty_cache, recorder=recorder,
                    set_aside=lambda source: set_aside(namespace, read_cell(source).rebinds, FakeMover(machine)))
    measured = measure_runs(runner, "x = make(batch)\n", 64, Batch())
    assert [r.recorded is not None for r in measured.runs] == [False, True, True]  # the first run finds the device
    assert recorder.devices == [0, 0]
    judged = judge(measured, 64)
    assert judged.replay_runs == (measured.get(SMALLER), measured.get(AGAIN))


class ProbeRunner:
    """What ``probe_workspaces`` asks of a runner: the smaller run again, fitting or not."""

    def __init__(self, fits: bool):
        self.fits = fits
        self.batches: list[tuple[str, int]] = []
        self.measured = Measured()

    def changed(self, change, label, batch):
        self.batches.append((label, batch))
        return Run(label, batch, 0, 0, oom=not self.fits)


def capper(capped: bool, caps: list[int]):
    @contextlib.contextmanager
    def cap_at(usable):
        caps.append(usable)
        yield capped
    return cap_at


@pytest.mark.parametrize("fits", [True, False])
def test_the_smaller_run_repeated_below_its_peak_says_whether_its_workspaces_are_optional(fits):
    runner, caps = ProbeRunner(fits), []
    smaller = recorded_run(SMALLER, 8)  # reserved peak 24 MiB, a 16 MiB workspace given back at once
    assert probe_workspaces(runner, None, smaller, capper(True, caps)) is True
    assert caps == [24 * MiB - 8 * MiB] and runner.batches == [(WORKSPACES, 8)]
    assert runner.measured.workspaces_optional is fits


def test_no_probe_without_a_cap_or_a_workspace_worth_refusing():
    runner, caps = ProbeRunner(True), []
    assert probe_workspaces(runner, None, recorded_run(SMALLER, 8), capper(False, caps)) is False
    assert runner.batches == [] and not runner.measured.workspaces_optional  # uncapped it proves nothing
    small = Run(SMALLER, 8, MiB, 0, peak_reserved_bytes=2 * MiB,
                recorded=RecordedRun((), ((ALLOC, 0, MiB, 0), (FREE, 0, 0, 0))))
    caps = []
    probe_workspaces(runner, None, small, capper(True, caps))
    assert caps == [] and runner.batches == []


class Oom(RuntimeError):
    pass


def test_the_probe_comes_after_the_lines_points_and_the_cell_runs_at_its_batch_last(hardware, machine):
    """A run that fails may leave what it made (gradients): it must not come between the line's points,
    and the cell's values must end as a run at the batch as written leaves them."""
    namespace = {"make": lambda batch: FakeTensor(20 * MiB * batch, machine=machine), "batch": 64, "capped": False}
    cell = "if capped: raise Oom()\nx = make(batch)\n"
    namespace["Oom"] = Oom

    class Batch:
        def apply(self, batch):
            namespace["batch"] = batch
            return cell

        def restore(self):
            namespace["batch"] = 64

    class WorkspaceRecorder(FakeRecorder):
        def stop(self, start, device, failed):  # a 40 MiB workspace given back at once
            return RecordedRun(start, ((ALLOC, 0, 40 * MiB, 0), (FREE, 0, 0, 0)))

    @contextlib.contextmanager
    def cap_at(usable):
        namespace["capped"] = True
        try:
            yield True
        finally:
            namespace["capped"] = False

    runner = Runner(Meter(hardware, reset_peak=True), lambda s: exec(s, namespace), lambda e: isinstance(e, Oom),
                    release=hardware.allocator.empty_cache, recorder=WorkspaceRecorder(machine),
                    set_aside=lambda source: set_aside(namespace, read_cell(source).rebinds, FakeMover(machine)))
    measured = measure_runs(runner, cell, 64, Batch(), cap_at=cap_at)
    assert [r.label for r in measured.runs] == [AS_WRITTEN, SMALLER, AGAIN, WORKSPACES, FINAL]
    assert measured.runs[3].oom and not measured.workspaces_optional
    judged = judge(measured, 64)
    assert judged.replay_runs == (measured.runs[1], measured.runs[2]) and not judged.workspaces_optional
    assert namespace["batch"] == 64 and namespace["x"].untyped_storage().nbytes() == 20 * MiB * 64


def step_then_optimizer_events(batch: int) -> tuple:
    """A fine-tune at small batches: the batch's activation (a MiB a sample) is freed by the backward pass,
    then the optimizer's step makes 40 MiB whatever the batch. Its peak is the step's up to batch 40."""
    return ((ALLOC, 0, batch * MiB, 0), (FREE, 0, 0, 0), (ALLOC, 1, 40 * MiB, 0), (FREE, 1, 0, 0))


def flat_run(label: str, batch: int, recorded: bool = True) -> Run:
    events = step_then_optimizer_events(batch)
    return Run(label, batch, 40 * MiB, 0, 0, peak_reserved_bytes=40 * MiB,
               recorded=RecordedRun((), events) if recorded else None)


def test_a_peak_that_does_not_grow_with_the_batch_is_planned_by_the_replay_of_its_two_runs():
    measured = Measured(runs=[flat_run(AS_WRITTEN, 16), flat_run(SMALLER, 8), flat_run(AGAIN, 16)])
    judged = judge(measured, 16)
    assert judged.line is not None and judged.line.slope_bytes == 0 and judged.line.intercept_bytes == 40 * MiB
    assert judged.replay_runs == (measured.get(SMALLER), measured.get(AGAIN))
    assert any("did not grow from batch 8 to 16" in note for note in judged.notes)
    plan = build_plan(measured.runs, 16, "batch", [CARD], DEFAULT_MARGIN, 0, "none here", line=judged.line,
                      replay_runs=judged.replay_runs, notes=judged.notes)
    # The step asks for its 40 MiB once the activation is freed (the allocator gives its cached segment
    # back when it must): 98 x 1.02 MiB fits the 100 MiB card, 99 does not, where the line has no answer.
    assert plan.replayed and plan.card(CARD.name).largest_batch == 98
    assert "whatever the batch measured" in plan.text()
    assert plan.figure() is not None and "whatever the batch measured" in plan._repr_html_()


def test_a_recorded_cell_that_asks_for_no_more_at_a_larger_batch_is_still_refused():
    # Not the batch: the same requests at 8 and 16, so the replay would fit any batch at all.
    def same_run(label: str, batch: int) -> Run:
        return Run(label, batch, 40 * MiB, 0, 0, recorded=RecordedRun((), step_then_optimizer_events(4)))

    measured = Measured(runs=[same_run(AS_WRITTEN, 16), same_run(SMALLER, 8), same_run(AGAIN, 16)])
    with pytest.raises(CudaMemError, match="is 16 really the cell's batch"):
        judge(measured, 16)


def test_under_autocast_a_flat_line_gives_no_autocast_line_and_says_why():
    autocast = Run(AUTOCAST, 16, 40 * MiB, 0, 0, autocast=True)
    measured = Measured(runs=[flat_run(AS_WRITTEN, 16), flat_run(SMALLER, 8), flat_run(AGAIN, 16), autocast])
    judged = judge(measured, 16)
    assert judged.autocast_line is None
    assert any(note.startswith("under autocast: no line either") for note in judged.notes)


def test_without_recordings_a_peak_that_does_not_grow_with_the_batch_is_still_refused_in_one_line():
    measured = Measured(runs=[flat_run(AS_WRITTEN, 16, False), flat_run(SMALLER, 8, False), flat_run(AGAIN, 16, False)])
    with pytest.raises(CudaMemError, match="the peak did not grow with the batch"):
        judge(measured, 16)
