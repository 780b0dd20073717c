import pickle

from jupyter_cudamem.trace import save_snapshot, summarize

USER = {"filename": "/tmp/ipykernel_1/123.py", "line": 3, "name": "<module>"}
USER_FN = {"filename": "/home/me/train.py", "line": 41, "name": "step"}
TORCH = {"filename": "/usr/lib/python3.12/site-packages/torch/nn/modules/linear.py", "line": 125, "name": "forward"}


def _event(action, addr, size, *frames):
    return {"action": action, "addr": addr, "size": size, "frames": list(frames)}


def _snapshot(events):
    return {"segments": [], "device_traces": [events]}


def test_sites_ranked_by_bytes_live_at_the_peak():
    events = [
        _event("alloc", 1, 100, TORCH, USER),  # weights: user line 3 via a torch frame
        _event("alloc", 2, 400, USER_FN),
        _event("alloc", 3, 300, USER_FN),
        _event("free_requested", 3, 300, USER_FN),
        _event("free_completed", 3, 300, USER_FN),
        _event("alloc", 4, 50, TORCH),  # no user frame at all
        _event("free_completed", 2, 400),
        _event("alloc", 5, 10, USER),
    ]
    summary = summarize(_snapshot(events), describe_file=lambda f: "In[3]" if f.endswith("123.py") else f)
    assert summary.traced_peak_bytes == 800  # allocations 1, 2, 3 live together
    assert [(s.location, s.bytes_at_peak) for s in summary.sites] == [
        ("/home/me/train.py line 41 in step", 700),
        ("In[3] line 3 in <module>", 100),
    ]


def test_frees_of_allocations_made_before_tracing_are_ignored():
    events = [_event("free_completed", 99, 1000), _event("alloc", 1, 10, USER)]
    summary = summarize(_snapshot(events))
    assert summary.traced_peak_bytes == 10
    assert summary.sites[0].bytes_at_peak == 10


def test_older_traces_without_free_completed_use_free_requested():
    events = [_event("alloc", 1, 10, USER), _event("free_requested", 1, 10), _event("alloc", 2, 5, USER)]
    assert summarize(_snapshot(events)).traced_peak_bytes == 10


def test_library_only_allocations_are_named_as_such():
    summary = summarize(_snapshot([_event("alloc", 1, 10, TORCH)]))
    assert summary.sites[0].location.startswith("inside libraries")


def test_empty_trace():
    summary = summarize({"device_traces": []})
    assert summary.sites == () and summary.traced_peak_bytes == 0


def test_snapshot_round_trips_as_pickle(tmp_path):
    snapshot = _snapshot([_event("alloc", 1, 10, USER)])
    path = save_snapshot(snapshot, tmp_path / "deep" / "cell.pickle")
    assert pickle.loads(path.read_bytes()) == snapshot
