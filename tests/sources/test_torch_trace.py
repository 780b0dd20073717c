"""Reading torch's allocator snapshot and history into the replay's words (sources/torch_trace.py).

Its windows and step marks are tested where they are used: tests/reruns/test_recording.py and
tests/oomfix/test_search_steps.py."""

from jupyter_cudamem.growth.replay import StartSegment
from jupyter_cudamem.sources.torch_trace import read_trace, start_segments, trace_rows
import pytest

# Nothing here runs a library whose version `make test-min` changes (tests/versioned.py).
pytestmark = pytest.mark.dependency_free

MiB = 1 << 20

SNAPSHOT = {
    "segments": [
        {"device": 0, "address": 40 * MiB, "segment_type": "large", "stream": 7,
         "blocks": [{"size": 20 * MiB, "state": "active_allocated"}]},
        {"device": 0, "address": 2 * MiB, "segment_type": "small", "stream": 0,
         "blocks": [{"size": 512, "state": "active_pending_free"}, {"size": 2 * MiB - 512, "state": "inactive"}]},
        {"device": 1, "address": 0, "segment_type": "large", "blocks": [{"size": 20 * MiB, "state": "inactive"}]},
    ],
    "device_traces": [
        [{"action": "alloc", "addr": 100 * MiB, "size": 3 * MiB, "stream": 0},
         {"action": "free_requested", "addr": 100 * MiB, "size": 3 * MiB, "stream": 0},
         {"action": "alloc", "addr": 200 * MiB, "size": MiB, "stream": 0},
         {"action": "free_completed", "addr": 100 * MiB, "size": 3 * MiB, "stream": 0},
         {"action": "free_completed", "addr": 2 * MiB, "size": 512, "stream": 0},
         {"action": "free_completed", "addr": 999 * MiB, "size": 512, "stream": 0}],
        [{"action": "alloc", "addr": 0, "size": 512, "stream": 0}],
    ],
}


def test_a_devices_segments_become_start_segments_in_address_order_with_their_active_blocks_held():
    assert start_segments(SNAPSHOT, 0) == (
        StartSegment(2 * MiB, True, ((512, True), (2 * MiB - 512, False)), 0),
        StartSegment(40 * MiB, False, ((20 * MiB, True),), 7),
    )
    assert start_segments(SNAPSHOT, 1) == (StartSegment(0, False, ((20 * MiB, False),), 0),)  # no stream: 0
    assert start_segments({}, 0) == ()


def test_a_devices_history_becomes_rows_of_action_address_size_and_stream():
    assert trace_rows(SNAPSHOT, 1) == [("alloc", 0, 512, 0)]
    assert trace_rows(SNAPSHOT, 0)[:2] == [("alloc", 100 * MiB, 3 * MiB, 0),
                                           ("free_requested", 100 * MiB, 3 * MiB, 0)]
    assert trace_rows(SNAPSHOT, 2) == []  # a device the history does not reach
    assert trace_rows({}, 0) == []


def test_a_snapshot_reads_into_events_from_its_start_and_what_the_run_left():
    start = start_segments(SNAPSHOT, 0)
    events, left = read_trace(trace_rows(SNAPSHOT, 0), start)
    # Allocations keyed by their event's index; a block held at the start keyed by its rank by (pool,
    # size, address): the large 20 MiB one is -1, the small 512-byte one -2. A free is read at
    # free_completed; a free of an address neither allocated nor held is not the allocator's.
    assert events == [("alloc", 0, 3 * MiB, 0), ("alloc", 1, MiB, 0), ("free", 0, 0, 0), ("free", -2, 0, 0)]
    assert left == ((200 * MiB, 1),)  # the start's 20 MiB block is still held, but the run did not make it
