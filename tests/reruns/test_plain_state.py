"""``reruns.plain_state``: the lists, dicts, counters and notebook objects a cell changes are found by
``model_state``'s walk and put back in place before each rerun (jupyter_cudamem/reruns/plain_state.py)."""

from __future__ import annotations

import argparse
import collections
import types

import pytest

from jupyter_cudamem.cell.read import read_cell
from jupyter_cudamem.reruns import plain_state
from jupyter_cudamem.reruns.model_state import Restorer, training_state

NOTEBOOK = '''
import collections, types
losses = []
history = {"loss": [], "acc": []}
step = 0
best = None
seen = set()
recent = collections.deque(maxlen=3)
counts = collections.Counter()
order = collections.OrderedDict(a=1, b=2)
config = types.SimpleNamespace(epoch=0)

class AverageMeter:
    def __init__(self):
        self.sum, self.count = 0.0, 0
    def update(self, value):
        self.sum += value
        self.count += 1

meter = AverageMeter()
log = []

def record(value, into=[]):
    log.append(value)  # a global the cell reaches only through this function
    into.append(value)  # a mutable default
'''

CELL = '''
loss = float(len(losses)) + 1.0
losses.append(loss)
history["loss"].append(loss)
history.setdefault("seen", 0)
step += 1
best = loss if best is None else max(best, loss)
seen.add(step)
recent.append(step)
counts["runs"] += 1
order["c"] = 3
order.move_to_end("a")
config.epoch += 1
meter.update(loss)
record(loss)
'''


def _notebook() -> dict:
    namespace: dict = {"__name__": "__main__"}
    exec(NOTEBOOK, namespace)
    return namespace


def _state(namespace: dict, source: str = CELL):
    read = read_cell(source, lambda text: text)
    return training_state(namespace, read.reads, read.binds_first)


def _snapshot(ns: dict) -> dict:
    """What one plain run of the cell must leave, as values (comparable after the reruns)."""
    return {
        "losses": list(ns["losses"]), "history": {k: (list(v) if isinstance(v, list) else v) for k, v in ns["history"].items()},
        "step": ns["step"], "best": ns["best"], "seen": set(ns["seen"]), "recent": list(ns["recent"]),
        "counts": dict(ns["counts"]), "order": list(ns["order"].items()), "epoch": ns["config"].epoch,
        "meter": (ns["meter"].sum, ns["meter"].count), "log": list(ns["log"]),
        "default": list(ns["record"].__defaults__[0]), "loss": ns.get("loss"),
    }


def test_three_reruns_leave_what_one_plain_run_leaves():
    plain_run = _notebook()
    exec(CELL, plain_run)
    expected = _snapshot(plain_run)

    namespace = _notebook()
    state = _state(namespace)
    history_list, meter = namespace["history"]["loss"], namespace["meter"]
    restorer = Restorer(state, namespace, copy_training=False)
    restorer.take()
    rerun = restorer.run(lambda source: exec(source, namespace))
    for _ in range(3):
        restorer.restore()  # before each rerun, as the driver does
        rerun(CELL)
    restorer.finish(last_fitted=True)
    assert _snapshot(namespace) == expected
    # Put back in place: other references to the same objects see it.
    assert namespace["history"]["loss"] is history_list and history_list == [1.0]
    assert namespace["meter"] is meter
    assert type(namespace["counts"]) is collections.Counter and type(namespace["order"]) is collections.OrderedDict
    assert set(state.plain.changed) == {
        "losses", "history['loss']", "history", "seen", "recent", "counts", "order", "config", "meter", "log",
        "record", "step", "best"}
    assert restorer.unrestored == []


def test_a_failed_last_rerun_leaves_them_as_before_the_reruns():
    namespace = _notebook()
    state = _state(namespace)
    restorer = Restorer(state, namespace, copy_training=False)
    restorer.take()
    restorer.run(lambda source: exec(source, namespace))(CELL)
    restorer.finish(last_fitted=False)
    assert namespace["losses"] == [] and namespace["step"] == 0 and namespace["meter"].count == 0
    assert namespace["log"] == [] and namespace["history"] == {"loss": [], "acc": []}


def test_nothing_changed_is_nothing_put_back():
    namespace = _notebook()
    state = _state(namespace, "total = len(losses) + step\n")
    restorer = Restorer(state, namespace, copy_training=False)
    restorer.take()
    rerun = restorer.run(lambda source: exec(source, namespace))
    rerun("total = len(losses) + step\n")
    restorer.restore()
    assert state.plain.changed == []


def test_names_the_cell_binds_before_reading_are_not_put_back():
    namespace = _notebook()
    namespace["outputs"] = ["old"]
    state = _state(namespace, "outputs = []\noutputs.append(1)\n")
    assert "outputs" not in state.plain.names
    assert all(path != "outputs" for _, path in state.plain.kept)


def test_other_libraries_objects_are_not_entered():
    namespace = _notebook()
    parser = argparse.ArgumentParser()
    namespace["parser"] = parser
    state = _state(namespace, "parser.add_argument('--x')\n")
    assert all(value is not parser._actions for value, _ in state.plain.kept)  # its internals are its own
    assert "parser" in state.plain.names  # its binding is still put back where the cell rebinds it


def test_a_container_too_large_to_copy_is_said_and_not_kept(monkeypatch):
    monkeypatch.setattr(plain_state, "MAX_ITEMS", 10)
    namespace = {"__name__": "__main__", "small": [1, 2], "large": list(range(100))}
    state = _state(namespace, "small.append(len(large))\nlarge.append(0)\n")
    assert state.plain.too_large == ["large"]
    assert [path for _, path in state.plain.kept] == ["small"]


def test_a_container_that_refuses_is_reported_not_raised():
    class Frozen(list):
        def __setitem__(self, index, value):
            raise TypeError("frozen")

    namespace = {"__name__": "__main__", "items": Frozen([1])}
    state = _state(namespace, "items.append(2)\n")
    restorer = Restorer(state, namespace, copy_training=False)
    restorer.take()
    restorer.run(lambda source: exec(source, namespace))("items.append(2)\n")
    restorer.restore()
    assert restorer.unrestored == ["items (TypeError: frozen)"]


@pytest.mark.parametrize("value", [types.SimpleNamespace(n=0), argparse.Namespace(n=0)])
def test_config_bags_are_kept(value):
    namespace = {"__name__": "__main__", "cfg": value}
    state = _state(namespace, "cfg.n += 1\n")
    state.plain.save(namespace)
    value.n += 1
    state.plain.restore(namespace)
    assert value.n == 0 and state.plain.changed == ["cfg"]


def test_a_notebook_modules_own_lists_are_kept_and_torchs_attributes_are_not():
    """Lightning's pattern: ``self.validation_step_outputs = []``, appended to at every step."""
    torch = pytest.importorskip("torch")
    namespace: dict = {"__name__": "__main__", "torch": torch}
    exec("class Net(torch.nn.Module):\n"
         "    def __init__(self):\n"
         "        super().__init__()\n"
         "        self.layer = torch.nn.Linear(2, 1)\n"
         "        self.outputs = []\n"
         "    def forward(self, x):\n"
         "        y = self.layer(x)\n"
         "        self.outputs.append(y.detach())\n"
         "        return y\n"
         "net = Net()\n", namespace)
    cell = "net(torch.ones(3, 2))\n"
    state = _state(namespace, cell)
    kept = {path for _, path in state.plain.kept}
    assert "net.outputs" in kept and not any("_parameters" in path or "_modules" in path for path in kept)
    restorer = Restorer(state, namespace, copy_training=False)
    restorer.take()
    rerun = restorer.run(lambda source: exec(source, namespace))
    for _ in range(3):
        restorer.restore()
        rerun(cell)
    assert len(namespace["net"].outputs) == 1 and state.plain.changed == ["net.outputs"]


def test_a_container_whose_own_methods_fail_is_reported_and_never_raises():
    class Broken(list):
        def __len__(self):
            raise RuntimeError("no length")

    class Unreadable(list):
        def __iter__(self):
            raise RuntimeError("no items")

    namespace = {"__name__": "__main__", "broken": Broken([1]), "unreadable": Unreadable([1]), "fine": []}
    cell = "broken.append(1)\nunreadable.append(1)\nfine.append(1)\n"
    state = _state(namespace, cell)
    assert "broken" not in {path for _, path in state.plain.kept}  # its length could not be read: not kept
    restorer = Restorer(state, namespace, copy_training=False)
    restorer.take()
    restorer.run(lambda source: exec(source, namespace))(cell)
    restorer.restore()
    assert namespace["fine"] == [] and restorer.unrestored == ["unreadable (RuntimeError: no items)"]
