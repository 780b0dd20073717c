import pickle

from jupyter_cudamem.trace import save_snapshot, summarize
import pytest

# Nothing here runs a library whose version `make test-min` changes (tests/versioned.py).
pytestmark = pytest.mark.dependency_free

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


CELL = "/tmp/ipykernel_1/555.py"
MODEL = "/tmp/ipykernel_1/222.py"
MAGIC_CALL = "/tmp/ipykernel_1/556.py"  # the cell as IPython ran it: get_ipython().run_cell_magic('cudamem', '', body)
NAMES = {CELL: "In[5]", MODEL: "In[2]", MAGIC_CALL: "In[5]"}  # the body is cached under its cell's number
RUN_CELL_MAGIC = (
    {"filename": "/work/src/jupyter_cudamem/magics/cellrun.py", "line": 300, "name": "run_body"},
    {"filename": "/usr/lib/python3.12/site-packages/IPython/core/interactiveshell.py", "line": 2541,
     "name": "run_cell_magic"},
    {"filename": MAGIC_CALL, "line": 1, "name": "<module>"},
)


def _loop(iterations, keep_every=1, extra_once=0, outside=()):
    """A traced cell: a loop whose body calls ``forward`` (In[2] line 8 keeps an activation, line 7 frees
    its temporary) and keeps the result of every ``keep_every``-th iteration."""
    events, addr = [], 0
    for iteration in range(iterations):
        for line, size, kept in ((7, 4096, False), (8, 2 * 1024**2, iteration % keep_every == 0)):
            addr += 1
            forward = {"filename": MODEL, "line": line, "name": "forward"}
            frames = [TORCH, forward, {"filename": CELL, "line": 4, "name": "<module>"}, *outside]
            events.append(_event("alloc", addr, size, *frames))
            if not kept:
                events.append(_event("free_completed", addr, size))
    if extra_once:
        events.append(_event("alloc", addr + 1, extra_once, {"filename": CELL, "line": 9, "name": "<module>"}))
    return _snapshot(events)


def _growth(snapshot):
    return summarize(
        snapshot,
        describe_file=lambda f: NAMES.get(f, f),
        source_line=lambda f, n: f"line {n} of {NAMES.get(f, f)}",
        is_cell_file=lambda f: NAMES.get(f) == "In[5]",
    ).growth


def test_a_loop_keeping_memory_every_iteration_is_tied_to_the_line_that_allocates_it():
    growth = _growth(_loop(40, extra_once=64 * 1024**2))
    assert growth is not None
    assert growth.iterations == 40 and growth.kept_iterations == 40
    assert growth.per_iteration_bytes == 2 * 1024**2 and growth.kept_bytes == 80 * 1024**2
    assert growth.location == "In[2] line 8 in forward" and growth.code == "line 8 of In[2]"
    assert growth.called_from == "In[5] line 4" and growth.called_from_code == "line 4 of In[5]"


def test_the_loop_is_called_from_the_users_line_in_the_body_not_the_magics_call():
    growth = _growth(_loop(40, outside=RUN_CELL_MAGIC))
    assert growth is not None and growth.location == "In[2] line 8 in forward"
    assert growth.called_from == "In[5] line 4" and growth.called_from_code == "line 4 of In[5]"


def test_a_loop_that_frees_what_it_made_or_keeps_only_once_is_not_growing():
    assert _growth(_loop(40, keep_every=1000)) is None  # only the first iteration's result stays
    assert _growth(_loop(2)) is None  # too few iterations to call it a trend


def test_growth_every_other_iteration_is_still_steady():
    growth = _growth(_loop(40, keep_every=2))
    assert growth is not None and growth.kept_iterations == 20 and growth.per_iteration_bytes == 1024**2


def test_several_allocations_of_one_size_per_iteration_are_placed_in_their_iteration():
    # A forward of a layer stack in one line: three 8 MiB activations per iteration, two kept, one freed.
    events, addr = [], 0
    line = {"filename": CELL, "line": 3, "name": "<module>"}
    for _ in range(20):
        for kept in (True, False, True):
            addr += 1
            events.append(_event("alloc", addr, 8 * 1024**2, TORCH, line))
            if not kept:
                events.append(_event("free_completed", addr, 8 * 1024**2))
        addr += 1
        events.append(_event("alloc", addr, 512, TORCH, line))  # the loss, kept
    growth = _growth(_snapshot(events))
    assert growth.iterations == 20 and growth.kept_iterations == 20
    assert growth.per_iteration_bytes == 16 * 1024**2 + 512 and growth.called_from is None
