"""The allocator replay against the real CUDA caching allocator under a per-process cap: a recorded
trace replays to the same outcome and the same segments, and two small runs predict the largest batch
that really fits (a program whose limit is set by a split block, not by the bytes it allocates)."""

from __future__ import annotations

import pytest

from jupyter_cudamem.growth.fitting import fitting_from_one, paired_fittings, paired_with_failure
from jupyter_cudamem.growth.replay import StartSegment, replay
from jupyter_cudamem.sources.torch_trace import events_from_trace

pytestmark = pytest.mark.gpu

MiB = 1 << 20
CAP = 600 * MiB


def fragmenting(torch, batch: int) -> None:
    """A freed block split by a smaller tensor that outlives it; the next, larger one needs a new segment."""
    first = torch.empty(2 * batch * MiB, dtype=torch.uint8, device="cuda")
    del first
    kept = torch.empty(batch * MiB, dtype=torch.uint8, device="cuda")
    last = torch.empty(4 * batch * MiB, dtype=torch.uint8, device="cuda")
    del kept, last


@pytest.fixture
def capped(torch):
    if not hasattr(torch.cuda.memory, "_record_memory_history"):
        pytest.skip("this torch cannot record allocator history")
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved()
    torch.cuda.set_per_process_memory_fraction((CAP + reserved) / total, 0)
    yield int((CAP + reserved) / total * total)
    torch.cuda.set_per_process_memory_fraction(1.0, 0)
    torch.cuda.empty_cache()


def masked(torch, batch: int) -> None:
    """``fragmenting`` with a 64 MiB tensor of fixed size (a mask) kept through it."""
    mask = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    fragmenting(torch, batch)
    del mask


def recorded(torch, batch: int, program=fragmenting):
    """(fitted, start segments, trace) of one run from an emptied cache, as the replay reads them."""
    torch.cuda.empty_cache()
    start = [StartSegment(s["address"], s["segment_type"] == "small",
                          tuple((b["size"], b["state"] != "inactive") for b in s["blocks"]), 0)
             for s in torch.cuda.memory._snapshot()["segments"]]
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python")
    try:
        program(torch, batch)
        fitted = True
    except torch.cuda.OutOfMemoryError:
        fitted = False
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = [[e["action"], e.get("addr"), e.get("size"), 0] for e in snapshot["device_traces"][0]
             if e["action"] in ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "oom")]
    return fitted, start, trace


@pytest.mark.parametrize("batch", [10, 60, 99, 100, 101, 120])
def test_a_recorded_run_replays_to_its_outcome_and_segments(torch, capped, batch):
    fitted, start, trace = recorded(torch, batch)
    result = replay(events_from_trace(trace, start, failed=not fitted), start, capped)
    assert result.fits == fitted
    assert list(result.segment_allocs) == [e[2] for e in trace if e[0] == "segment_alloc"]
    assert list(result.segment_frees) == [e[2] for e in trace if e[0] == "segment_free"]


def test_two_small_runs_predict_the_largest_batch_that_really_fits(torch, capped):
    _, start, low = recorded(torch, 10)
    _, _, high = recorded(torch, 20)
    paired = paired_fittings(events_from_trace(low, start), 10, events_from_trace(high, start), 20, start)
    assert paired is not None
    predicted = paired(capped, 0.0).largest()
    assert recorded(torch, predicted)[0]
    assert not recorded(torch, predicted + 1)[0]


def test_a_failed_runs_recorded_requests_with_one_small_run_predict_the_largest_batch_that_really_fits(torch, capped):
    # One run at 4 scales the mask with the batch (16 MiB a sample); the run that failed at 150 made it at
    # its size before it raised, and its other requests at theirs.
    fitted, start, low = recorded(torch, 4, masked)
    failed, _, high = recorded(torch, 150, masked)
    assert fitted and not failed
    under = paired_with_failure(events_from_trace(low, start), 4, events_from_trace(high, start, failed=True), 150, start)
    one = fitting_from_one(events_from_trace(low, start), 4, start, capped)
    assert under is not None and one is not None
    paired = under(capped, 0.0)
    assert not paired.fits(150)  # it replays the failure, as the search asks before it trusts it
    predicted = paired.largest(149)
    assert recorded(torch, predicted, masked)[0]
    assert not recorded(torch, predicted + 1, masked)[0]
    assert one.largest(149) < 0.8 * predicted
