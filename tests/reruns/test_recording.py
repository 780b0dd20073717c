"""Recording a rerun's allocations for the replay (reruns/recording.py), on the fake allocator."""

from __future__ import annotations

from jupyter_cudamem.reruns.recording import MAX_EVENTS, RecordedRun, Recorder, start_segments
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


def test_someone_elses_recording_is_left_alone():
    fake = allocator()
    fake.snapshot = lambda: {"segments": [], "device_traces": [[TRACE[0]]]}  # the user records already
    stopped = []
    fake.stop_trace = lambda: stopped.append(True) or {}
    recorder = Recorder(fake)
    assert recorder.start(0) is None and not fake.tracing
    assert recorder.stop(None, 0, failed=False) is None and not stopped  # their recording goes on


def test_what_cannot_be_recorded_is_not_replayed():
    fake = allocator()
    fake.trace_entries = [TRACE[0]] * MAX_EVENTS  # the ring buffer may have dropped the beginning
    recorder = Recorder(fake)
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
    outcome = driver.fix(source, fail_first(run, source), namespace, freed_bytes=0)
    batch_tries = [t for t in outcome.tries if t.batch is not None]
    assert batch_tries and all(isinstance(t.recorded, RecordedRun) for t in batch_tries)
    assert all(t.observation().recorded is t.recorded for t in batch_tries if t.fitted)
    assert "recorded" not in repr(batch_tries[0])  # a try's repr does not dump its events
    assert not fake.tracing and outcome.fitted


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
        driver.fix(source, fail_first(run, source), namespace, freed_bytes=0)
    assert not fake.tracing
