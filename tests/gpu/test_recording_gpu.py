"""A rerun longer than the allocator's history, recorded on the real CUDA caching allocator: kept as a window
of its last events that replays to the run's measured peak, and not kept where its peak came before the
window (``reruns.recording``)."""

from __future__ import annotations

import pytest

from jupyter_cudamem.growth.replay import replay
from jupyter_cudamem.reruns.recording import WINDOW_EVENTS, Recorder

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def loop_run(torch, first_pass_mib: int):
    """A cell that runs one step over its data a batch at a time, keeping each pass's small output, long
    enough that the history drops its beginning; its first pass takes a tensor of ``first_pass_mib``."""
    from jupyter_cudamem.sources.torch_alloc import TorchAllocator

    source = TorchAllocator()
    torch.cuda.empty_cache()
    weights = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    recorder = Recorder(source, windows=True)
    source.reset_peak(0)
    start = recorder.start(0)
    assert start is not None
    outputs = []
    first = torch.empty(first_pass_mib * MiB, dtype=torch.uint8, device="cuda")
    del first
    for _ in range(WINDOW_EVENTS // 12 + 2_000):  # about 12 history rows a pass
        inputs = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
        hidden = torch.empty(24 * MiB, dtype=torch.uint8, device="cuda")
        scores = torch.empty(300 * 1024, dtype=torch.uint8, device="cuda")
        del scores
        logits = torch.empty(16 * MiB, dtype=torch.uint8, device="cuda")
        del hidden
        outputs.append(torch.empty(4096, dtype=torch.uint8, device="cuda"))
        del logits, inputs
    torch.cuda.synchronize()
    recorded = recorder.stop(start, 0, failed=False)
    measured = source.read(0).peak_allocated_bytes
    del weights, outputs
    torch.cuda.empty_cache()
    return recorded, measured


def test_a_run_longer_than_the_history_is_kept_as_a_window_that_replays_to_its_measured_peak(torch):
    recorded, measured = loop_run(torch, first_pass_mib=1)
    assert recorded is not None and not recorded.whole
    replayed = replay(recorded.events, recorded.start, 1 << 62).peak_allocated_bytes
    assert abs(replayed - measured) <= 2 * MiB, (replayed, measured)


def test_a_run_whose_peak_came_before_the_window_is_not_kept(torch):
    recorded, _ = loop_run(torch, first_pass_mib=256)
    assert recorded is None


def test_a_recording_the_user_started_is_read_for_the_rerun_and_left_running(torch):
    from jupyter_cudamem.sources.torch_alloc import TorchAllocator

    source = TorchAllocator()
    torch.cuda.empty_cache()
    torch.cuda.memory._record_memory_history(max_entries=100_000)  # the user's, with stacks
    try:
        before = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")  # theirs, before the rerun
        recorder = Recorder(source)
        start = recorder.start(0)
        assert start is not None
        made = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        del made
        torch.cuda.synchronize()
        recorded = recorder.stop(start, 0, failed=False)
        assert recorded is not None and recorded.whole
        assert [(kind, size) for kind, _, size, _ in recorded.events if kind == "alloc"] == [("alloc", 64 * MiB)]
        after = torch.empty(2 * MiB, dtype=torch.uint8, device="cuda")
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
        assert trace[-1]["action"] == "alloc" and trace[-1]["size"] == 2 * MiB  # still recording
        assert trace[-1]["frames"]  # with the stacks the user asked for
        del before, after
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
        torch.cuda.empty_cache()
