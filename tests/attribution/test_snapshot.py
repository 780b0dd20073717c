"""The fingerprint taken before every cell (``NamespaceSnapshot.take``): its fast paths say what the
per-object ``fingerprint`` says, and what they exist to see is still seen: a name rebound to a new
object is new, a list appended in place grew, a tensor that got a gradient changed."""

from __future__ import annotations

import collections

import pytest

from jupyter_cudamem.attribution.left_records import Cause, Change
from jupyter_cudamem.attribution.left import left_behind
from jupyter_cudamem.attribution.snapshot import NamespaceSnapshot, _first_parameter, fingerprint
from tests.fakes import FakeModule, FakeOptimizer, FakeTensor, MiB, fake_probe, torch_cpu_probe

torch = pytest.importorskip("torch")


class _Object:
    def __init__(self, **attributes):
        self.__dict__.update(attributes)


class _NoLength(list):
    def __len__(self):
        raise RuntimeError("no length here")


def _namespace():
    leaf = torch.ones(4, requires_grad=True)
    (leaf * 2).sum().backward()  # leaf.grad set
    kept = leaf * 3
    kept.retain_grad()
    kept.sum().backward()  # a non-leaf with a retained gradient
    nested = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Sequential(torch.nn.Linear(2, 2)))
    model = torch.nn.Linear(3, 3)
    return {
        "x": torch.zeros(8),
        "leaf": leaf,
        "kept": kept,
        "computed": leaf * 5,  # a non-leaf: its .grad is never read
        "param": torch.nn.Parameter(torch.zeros(2)),
        "items": [torch.zeros(1), 1],
        "table": {"a": torch.zeros(1)},
        "pair": (1, 2),
        "group": {1, 2, 3},
        "frozen": frozenset({1}),
        "queue": collections.deque([1, 2]),
        "broken": _NoLength([1]),
        "model": model,
        "nested": nested,
        "empty_module": torch.nn.ReLU(),
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "holder": _Object(tensor=torch.zeros(2), history=[1, 2], step=3, name="run"),
        "wide": _Object(**{f"a{index}": [index] for index in range(100)}),
        "nested": {"losses": [1, 2], "t": torch.zeros(1), "acts": {}},
        "long": [[index] for index in range(100)],
        "runs": [[], collections.deque([1]), collections.defaultdict(list)],
        "number": 1.5,
        "text": "hello",
        "none": None,
        "function": _namespace,
        "module": collections,
        "kind": _Object,
        "fake": FakeTensor(MiB),
        "fake_module": FakeModule({"w": FakeTensor(MiB)}),
        "fake_optimizer": FakeOptimizer([FakeTensor(MiB)]),
    }


@pytest.mark.parametrize("make_probe", [torch_cpu_probe, fake_probe])
def test_the_snapshot_equals_the_per_object_fingerprint_name_by_name(make_probe):
    probe = make_probe()
    namespace = _namespace()
    snapshot = NamespaceSnapshot.take(namespace, (), probe)
    assert list(snapshot.names) == list(namespace)
    for name, value in namespace.items():
        assert snapshot.names[name] == fingerprint(value, probe), name


def test_a_tensor_fingerprint_reads_the_gradient_only_where_pytorch_keeps_one():
    probe = torch_cpu_probe()
    leaf = torch.ones(2, requires_grad=True)
    computed = leaf * 2
    assert fingerprint(leaf, probe) == (id(leaf), id(None))
    computed.sum().backward()
    assert fingerprint(leaf, probe) == (id(leaf), id(leaf.grad))
    with _no_warning():
        assert fingerprint(leaf * 2, probe)[1] == id(None)  # a non-leaf's .grad is not read (it warns)


class _no_warning:
    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        self._catch.__exit__(*exc)
        return False


def test_the_first_parameter_is_the_one_parameters_yields_first():
    cases = [
        torch.nn.Linear(2, 2),
        torch.nn.ReLU(),
        torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Sequential(torch.nn.Dropout(), torch.nn.Linear(2, 2))),
        torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)),
        torch.nn.LSTM(2, 2),
        FakeModule({}, child=FakeModule({"w": FakeTensor(MiB)})),
    ]
    shared = torch.nn.Linear(2, 2)
    cases.append(torch.nn.Sequential(shared, shared))
    without_bias = torch.nn.Linear(2, 2, bias=False)
    without_bias.register_parameter("late", None)  # a None slot is skipped as parameters() skips it
    cases.append(without_bias)
    for module in cases:
        assert _first_parameter(module) is next(iter(module.parameters()), None), module


def test_container_attributes_are_told_by_type_without_isinstance_on_tensors():
    probe = torch_cpu_probe()
    holder = _Object(tensor=torch.zeros(2), history=[1, 2], table={}, queue=collections.deque([1]), step=3)
    printed = fingerprint(holder, probe)
    assert printed[0] == id(holder)
    assert [(name, size) for name, _, size in printed[1]] == [
        ("tensor", -1),
        ("history", 2),
        ("table", 0),
        ("queue", 1),
        ("step", -1),
    ]


# -- what the shortcut must keep seeing, end to end ------------------------------------------------
def test_a_name_rebound_to_a_new_object_is_new():
    probe = fake_probe()
    namespace = {"x": FakeTensor(MiB), "other": [FakeTensor(MiB)]}
    before = NamespaceSnapshot.take(namespace, (), probe)
    namespace["x"] = FakeTensor(64 * MiB)
    left = left_behind(namespace, (), before, 64 * MiB, probe)
    assert [(h.name, h.change, h.nbytes) for h in left.holders] == [("x", Change.REBOUND, 64 * MiB)]


def test_a_list_appended_in_place_grew_and_only_its_new_items_count():
    probe = fake_probe()
    history = [FakeTensor(8 * MiB)]
    namespace = {"history": history, "n": 1}
    before = NamespaceSnapshot.take(namespace, (), probe)
    history.append(FakeTensor(64 * MiB))
    left = left_behind(namespace, (), before, 64 * MiB, probe)
    assert [(h.name, h.change, h.nbytes) for h in left.holders] == [("history", Change.GREW, 64 * MiB)]


def test_an_attribute_list_appended_in_place_is_a_change_of_that_attribute():
    probe = fake_probe()
    tracker = _Object(history=[FakeTensor(8 * MiB)], model=FakeTensor(8 * MiB))
    namespace = {"tracker": tracker}
    before = NamespaceSnapshot.take(namespace, (), probe)
    tracker.history.append(FakeTensor(64 * MiB))
    left = left_behind(namespace, (), before, 64 * MiB, probe)
    assert [(h.name, h.change, h.nbytes, h.where) for h in left.holders] == [
        ("tracker", Change.CHANGED, 64 * MiB, "tracker.history")
    ]


def test_a_tensor_that_got_its_gradient_in_place_changed():
    probe = torch_cpu_probe()
    weight = torch.zeros(256, 1024, requires_grad=True)  # 1 MiB
    namespace = {"weight": weight}
    before = NamespaceSnapshot.take(namespace, (), probe)
    (weight * 2).sum().backward()
    left = left_behind(namespace, (), before, 1 * MiB, probe)
    assert [(h.name, h.change, h.cause) for h in left.holders] == [("weight", Change.CHANGED, Cause.GRADIENTS)]


def test_a_mixed_namespace_of_thousands_of_names_attributes_only_what_changed():
    """The fast paths on many names at once: one rebound, one grown, the rest old."""
    probe = fake_probe()
    namespace = {}
    for index in range(3000):
        kind = index % 4
        tensor = FakeTensor(4096)
        namespace[f"v{index}"] = (
            tensor if kind == 0 else [tensor] if kind == 1 else {"t": tensor} if kind == 2 else _Object(t=tensor)
        )
    before = NamespaceSnapshot.take(namespace, (), probe)
    namespace["v0"] = FakeTensor(32 * MiB)
    namespace["v1"].append(FakeTensor(32 * MiB))
    left = left_behind(namespace, (), before, 64 * MiB, probe)
    assert sorted((h.name, h.change, h.nbytes) for h in left.holders) == [
        ("v0", Change.REBOUND, 32 * MiB),
        ("v1", Change.GREW, 32 * MiB),
    ]
    assert left.remainder_bytes == 0


def test_a_container_that_raises_on_length_is_fingerprinted_by_its_id():
    probe = torch_cpu_probe()
    broken = _NoLength([1])
    assert NamespaceSnapshot.take({"broken": broken}, (), probe).names["broken"] == (id(broken),)


def test_a_container_fingerprint_holds_the_lengths_of_the_containers_among_its_children():
    probe = torch_cpu_probe()
    losses, tensor = [1, 2], torch.zeros(1)
    history = {"losses": losses, "t": tensor, "step": 3}
    assert fingerprint(history, probe) == (id(history), 3, ((id(losses), 2),))
    assert fingerprint({"t": tensor, "step": 3}, probe)[2] == ()
    long = [[index] for index in range(100)]
    printed = fingerprint(long, probe)
    assert printed[1] == 100 and len(printed[2]) == 64  # the first 64 only
