"""Recording a rerun's allocations for the replay (reruns/recording.py), on the fake allocator."""

from __future__ import annotations

from jupyter_cudamem.cell.read import read_cell
from jupyter_cudamem.growth.replay import RecordedRun
from jupyter_cudamem.reruns.recording import MAX_EVENTS, Recorder
from jupyter_cudamem.sources.torch_trace import start_segments
from jupyter_cudamem.growth.replay import StartSegment
from tests.fakes import FakeAllocator, FakeMachine, MiB
from tests.oomfix.test_driver import TRAINING_CELL, fail_first, setup

SEGMENT = {"device": 0, "address": 4096, "total_size": 20 * MiB, "segment_type": "large", "stream": 0,
           "blocks": [{"size": 2 * MiB, "state": "active_allocated"}, {"size": 18 * MiB, "state": "inactive"}]}
TRACE = [{"action": "alloc", "addr": 1 << 30, "size": 64 * MiB, "stream": 0},
         {"action": "free_requested", "addr": 1 << 30, "size": 64 * MiB, "stream": 0},
         {"action": "free_completed", "addr": 1 << 30, "size": 64 * MiB, "stream": 0},
         {"action": "segment_alloc", "addr": 1 << 30, "size": 64 * MiB, "stream": 0}]


def allocator() -> FakeAllocator:
    fake = FakeAllocator(FakeMachine())
    fake.snapshot_segments = [SEGMENT, {**SEGMENT, "device": 1, "address": 8192}]
    fake.trace_entries = list(TRACE)
    return fake


def test_a_rerun_is_recorded_without_stacks_from_the_segments_it_started_with():
    fake = allocator()
    recorder = Recorder(fake)
    start = recorder.start(0)
    assert fake.tracing and fake.trace_stacks is False
    assert start == (StartSegment(4096, False, ((2 * MiB, True), (18 * MiB, False)), 0),)
    run = recorder.stop(start, 0, failed=False)
    assert not fake.tracing
    assert isinstance(run, RecordedRun) and run.start == start
    assert [(kind, size) for kind, _, size, _ in run.events] == [("alloc", 64 * MiB), ("free", 0)]


USERS = {"action": "alloc", "addr": 1 << 33, "size": 8 * MiB, "stream": 0, "frames": [{"line": 3}]}


def test_a_recording_the_user_started_is_read_from_where_it_stood_and_left_running():
    fake = allocator()
    fake.snapshot = lambda: {"segments": [SEGMENT], "device_traces": [[USERS]]}  # the user records already
    fake.trace_entries = [USERS, *TRACE]
    recorder = Recorder(fake)
    start = recorder.start(0)
    assert fake.tracing and fake.trace_stacks is None  # joined: their settings stand
    run = recorder.stop(start, 0, failed=False)
    assert fake.tracing  # their recording goes on
    assert isinstance(run, RecordedRun)
    assert [(kind, size) for kind, _, size, _ in run.events] == [("alloc", 64 * MiB), ("free", 0)]  # not theirs


def test_a_users_history_whose_ring_dropped_where_the_rerun_began_is_not_replayed():
    fake = allocator()
    fake.snapshot = lambda: {"segments": [SEGMENT], "device_traces": [[USERS, USERS]]}
    fake.trace_entries = [USERS, *TRACE[:1]]  # as long as before: the ring is full, its end moved
    recorder = Recorder(fake)
    assert recorder.stop(recorder.start(0), 0, failed=False) is None
    assert fake.tracing  # still theirs, still on


def test_what_cannot_be_recorded_is_not_replayed():
    fake = allocator()
    fake.trace_entries = [TRACE[0]] * MAX_EVENTS  # the ring buffer may have dropped the beginning
    recorder = Recorder(fake)  # no windows: the plan's
    assert recorder.stop(recorder.start(0), 0, failed=False) is None
    broken = allocator()

    def no_snapshot():
        raise AttributeError("this torch has no _snapshot")

    broken.snapshot = no_snapshot
    assert Recorder(broken).start(0) is None and Recorder(broken).state(0) is None
    assert start_segments({"segments": [SEGMENT]}, 1) == ()  # another device's segments are not ours


def test_each_batch_try_of_a_fix_is_recorded_and_the_search_gets_the_allocators_state():
    _, cell, namespace, run, driver, _ = setup()
    fake = driver.hardware.allocator
    fake.snapshot_segments = [SEGMENT]
    fake.trace_entries = list(TRACE)
    true_max = cell.largest_fitting(20000)
    source = TRAINING_CELL.format(batch=8 * true_max)
    outcome = driver.fix(read_cell(source), fail_first(run, source), namespace, freed_bytes=0)
    batch_tries = [t for t in outcome.tries if t.batch is not None]
    assert batch_tries and all(isinstance(t.recorded, RecordedRun) for t in batch_tries)
    # Failed tries too: their requests up to the one that raised say which of a fitted run's grow.
    assert all(t.observation().recorded is t.recorded for t in batch_tries)
    assert "recorded" not in repr(batch_tries[0])  # a try's repr does not dump its events
    assert not fake.tracing and outcome.fitted


def test_a_failed_try_hands_the_search_its_requests_up_to_the_failure():
    from jupyter_cudamem.oomfix.outcome import TryResult
    from jupyter_cudamem.oomfix.strategies import Strategy

    run = RecordedRun((), (("alloc", 0, 64 * MiB, 0), ("alloc", 1, 512 * MiB, 0)))
    failed = TryResult(2, Strategy.BATCH, "b=80", False, True, 64 * MiB, 0.1, "replay", batch=80,
                       need_bytes=576 * MiB, recorded=run)
    observation = failed.observation()
    assert not observation.fitted and observation.recorded is run


def test_an_interrupted_try_stops_the_recording():
    import pytest

    _, cell, namespace, run, driver, _ = setup()
    fake = driver.hardware.allocator
    fake.trace_entries = list(TRACE)

    def interrupted(source):
        if fake.tracing:
            raise KeyboardInterrupt
        return run(source)

    driver.run_source = interrupted
    source = TRAINING_CELL.format(batch=8 * cell.largest_fitting(20000))
    with pytest.raises(KeyboardInterrupt):
        driver.fix(read_cell(source), fail_first(run, source), namespace, freed_bytes=0)
    assert not fake.tracing


# -- a window of a run too long for the history ----------------------------------------------------------
WEIGHTS = (StartSegment(1 << 32, False, ((64 * MiB, True), (36 * MiB, False))),)


def _rows(entries) -> list[tuple]:
    return [(e["action"], e["addr"], e["size"], e["stream"]) for e in entries]


def _live_after(events, start, count: int) -> list[int]:
    """The requested bytes of every block allocated after the first ``count`` events, from ``start``."""
    from jupyter_cudamem.growth.replay import FREE, allocated_blocks, start_keys

    sizes = allocated_blocks(start)
    live = {key: sizes[address] for address, key in start_keys(start).items()}
    for kind, key, size, _ in events[:count]:
        if kind == FREE:
            live.pop(key, None)
        else:
            live[key] = size
    return sorted(live.values())


def test_a_window_of_a_run_begins_with_what_the_run_held_when_the_window_began():
    import random

    from jupyter_cudamem.sources.torch_trace import read_trace, window_prologue
    from tests.reruns.torch_like import TorchLikeRun

    rng = random.Random(11)
    run = TorchLikeRun(WEIGHTS)
    names = iter(range(10**6))
    boundaries = []  # (rows so far, what was allocated then)
    for _ in range(1500):
        live = [name for name in run.live_blocks if name != ("start", WEIGHTS[0].address)]
        if live and (len(live) > 12 or rng.random() < 0.45):
            run.free(rng.choice(live))
        elif rng.random() < 0.05 and ("start", WEIGHTS[0].address) in run.live_blocks:
            run.free(("start", WEIGHTS[0].address))  # the cell drops a tensor it started with
        else:
            size = rng.choice([rng.randrange(1, 1 << 20), rng.randrange(1 << 20, 10 << 20),
                               rng.randrange(10 << 20, 40 << 20)])
            run.alloc(next(names), size)
        boundaries.append((len(run.rows), run.live()))
    end = {"segments": run.segments()}
    rows = _rows(run.rows)
    for count, held in boundaries[100::97]:
        window = rows[count:]
        prologue = window_prologue(end, window, WEIGHTS, 0)
        assert prologue is not None
        events, _ = read_trace(prologue + window, WEIGHTS)
        assert _live_after(events, WEIGHTS, len(prologue)) == held
        assert _live_after(events, WEIGHTS, len(events)) == run.live()
    # Rows that do not undo to a state (an allocation of a block the end does not hold, twice): no window.
    assert window_prologue(end, rows[-10:] + rows[-10:], WEIGHTS, 0) is None


def _loop_run(passes: int, first_pass_scale: int = 1):
    """A cell that runs the same step over its data a batch at a time, keeping each pass's small output."""
    from tests.reruns.torch_like import TorchLikeRun

    run = TorchLikeRun(WEIGHTS)
    for step in range(passes):
        scale = first_pass_scale if step == 0 else 1
        run.alloc(("input", step), scale * 12 * MiB)
        run.alloc(("hidden", step), scale * 24 * MiB)
        run.alloc(("scores", step), scale * 300 * 1024)
        run.free(("scores", step))
        run.alloc(("logits", step), scale * 16 * MiB)
        run.free(("hidden", step))
        run.alloc(("output", step), 4096)
        run.free(("logits", step))
        run.free(("input", step))
    return run


def _record(run, windows: bool, kept: int):
    fake = FakeAllocator(FakeMachine())
    fake.snapshot_segments = [
        {"device": 0, "address": WEIGHTS[0].address, "total_size": 100 * MiB, "segment_type": "large", "stream": 0,
         "blocks": [{"size": 64 * MiB, "state": "active_allocated"}, {"size": 36 * MiB, "state": "inactive"}]}]
    recorder = Recorder(fake, windows=windows)
    recorder.max_events = kept  # the history, short enough for a test's run
    start = recorder.start(0)
    assert start == WEIGHTS
    fake.snapshot_segments = run.segments()
    fake.trace_entries = run.rows[-kept:]
    fake.machine.gpus[0].peak_allocated = run.peak_allocated
    return recorder.stop(start, 0, failed=False)


def test_a_run_longer_than_the_history_is_kept_as_a_window_that_replays_to_its_peak():
    from jupyter_cudamem.growth.replay import ALLOC, replay

    run = _loop_run(40)
    assert len(run.rows) > 400
    recorded = _record(run, windows=True, kept=400)
    assert isinstance(recorded, RecordedRun) and not recorded.whole and recorded.start == WEIGHTS
    assert replay(recorded.events, WEIGHTS, 1 << 40).peak_allocated_bytes == run.peak_allocated
    assert _live_after(recorded.events, WEIGHTS, len(recorded.events)) == run.live()
    assert len(recorded.left) == 40  # each pass's output, made before the window or in it
    # What the run held when the window began is carried at its size: the earlier passes' outputs.
    carried = sorted(size for kind, key, size, _ in recorded.events if kind == ALLOC and key in recorded.carried)
    held_then: dict[int, int] = {}
    for row in run.rows[:-400]:
        if row["action"] == "alloc":
            held_then[row["addr"]] = row["size"]
        elif row["action"] == "free_completed":
            held_then.pop(row["addr"])
    assert carried == sorted(held_then.values()) and carried.count(4096) > 1
    # The plan's recorder keeps whole runs only.
    assert _record(_loop_run(40), windows=False, kept=400) is None
    # A run the history held whole is recorded whole.
    whole = _record(_loop_run(40), windows=True, kept=len(run.rows) + 1)
    assert whole is not None and whole.whole and not whole.carried


def test_a_window_after_the_runs_peak_is_not_kept():
    run = _loop_run(40, first_pass_scale=2)  # the first pass, long before the window, was the largest
    assert _record(run, windows=True, kept=400) is None


def test_a_window_that_began_inside_the_pass_of_the_peak_is_not_kept():
    # The last pass makes its largest tensor, then more small requests than the history keeps: the window
    # holds that tensor only as carried in (made before it, freed in it), whose size the replay would keep
    # at every batch. Its replay at the run's own batch reaches the peak only with it.
    run = _loop_run(40)
    run.alloc("huge", 96 * MiB)  # above any pass's 52 MiB: the run's peak
    for i in range(300):
        run.alloc(("small", i), 4096)
        run.free(("small", i))
    run.free("huge")
    assert _record(run, windows=True, kept=400) is None


def test_the_optimizers_steps_are_marked_and_their_marks_leave_the_run():
    fake = allocator()
    first, second, state = 1 << 31, (1 << 31) + 512, 1 << 32
    fake.trace_entries = [TRACE[0],  # the batch's, freed before the step
                          {"action": "free_completed", "addr": 1 << 30, "size": 64 * MiB, "stream": 0},
                          {"action": "alloc", "addr": first, "size": 1, "stream": 0},
                          {"action": "alloc", "addr": second, "size": 3, "stream": 0},
                          {"action": "free_requested", "addr": second, "size": 3, "stream": 0},
                          {"action": "free_completed", "addr": second, "size": 3, "stream": 0},
                          {"action": "alloc", "addr": state, "size": 8 * MiB, "stream": 0},  # the step's state
                          {"action": "free_requested", "addr": first, "size": 1, "stream": 0},
                          {"action": "free_completed", "addr": first, "size": 1, "stream": 0}]
    fake.step_marks = [(0, first, second)]
    recorder = Recorder(fake)
    run = recorder.stop(recorder.start(0), 0, failed=False)
    assert fake.marking_steps and run is not None
    assert [(kind, size) for kind, _, size, _ in run.events] == [("alloc", 64 * MiB), ("free", 0), ("alloc", 8 * MiB)]
    assert run.steps == ((2, 3),)  # the state's request, made within the step
