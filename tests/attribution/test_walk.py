"""The walk's reading of autograd graphs and module hooks, with fake nodes for what only some PyTorch
versions have, and real CPU tensors for the rest."""

from __future__ import annotations

import functools

import pytest

from jupyter_cudamem.attribution.probe import module_hooks, saved_by
from jupyter_cudamem.attribution.walk import ReachedAs, describe_path, walk
from tests.fakes import FakeModule, FakeTensor, MiB, fake_probe, torch_cpu_probe


class _Saved:
    """A ``SavedTensor`` of PyTorch 2.4+: ``data`` without running the unpack hook."""

    def __init__(self, data, hook=None):
        self.data = data
        self.unpack_hook = hook


class _Node:
    def __init__(self, *children, **saved):
        self.next_functions = tuple((child, 0) for child in children)
        for name, value in saved.items():
            setattr(self, "_raw_saved_" + name, value)


class _OldNode:
    """A node of older PyTorch: ``_raw_saved_x`` without ``data``, the tensor only through ``_saved_x``."""

    __slots__ = ("_tensor",)  # C++ nodes have no __dict__: only a custom Function's ctx has one
    unpacked = 0

    def __init__(self, tensor):
        self._tensor = tensor

    @property
    def _raw_saved_self(self):
        return object()

    @property
    def _saved_self(self):
        type(self).unpacked += 1
        return self._tensor


class _NoopSaveInputsBackward:  # the marker of a non-reentrant checkpoint
    next_functions = ()


def test_saved_tensors_are_read_without_unpack_hooks_and_packed_data_is_walked():
    kept = FakeTensor(3 * MiB)
    offloaded = FakeTensor(5 * MiB, device="cpu")
    node = _Node(_Node(other=_Saved(kept)), packed=_Saved((offloaded,), hook=lambda packed: 1 / 0))
    loss = FakeTensor(4)
    loss.grad_fn = node
    reach = walk(loss, fake_probe())
    categories = reach.by_category()
    assert categories[ReachedAs.GRAPH] == 3 * MiB  # the CPU copy a save_on_cpu hook made is not device memory
    assert reach.graph_tensors == 1 and reach.scalar_graph_tensors == 1  # a one-element loss


def test_old_pytorch_unpacks_saved_tensors_except_in_checkpointed_graphs():
    kept = FakeTensor(2 * MiB)
    loss = FakeTensor(4)
    loss.grad_fn = _Node(_OldNode(kept))
    _OldNode.unpacked = 0
    assert walk(loss, fake_probe()).by_category()[ReachedAs.GRAPH] == 2 * MiB
    assert _OldNode.unpacked == 1

    hooked = FakeTensor(4)
    hooked.grad_fn = _Node(_OldNode(kept), _NoopSaveInputsBackward())
    assert walk(hooked, fake_probe()).by_category().get(ReachedAs.GRAPH, 0) == 0
    assert _OldNode.unpacked == 1  # not unpacked: that would rerun the checkpointed forward


def test_saved_tensors_freed_by_backward_count_nothing():
    torch = pytest.importorskip("torch")
    w = torch.randn(256, 256, requires_grad=True)
    loss = (torch.randn(64, 256) @ w).relu().sum()
    probe = torch_cpu_probe()
    assert walk(loss, probe).by_category()[ReachedAs.GRAPH] > 0
    loss.backward()
    node = loss.grad_fn.next_functions[0][0]
    assert list(saved_by(node, may_unpack=True)) == []
    assert ReachedAs.GRAPH not in walk(loss, probe).by_category()


def test_hooks_of_every_kind_with_what_they_captured():
    store = [FakeTensor(2 * MiB)]

    class Keeper:
        def __init__(self):
            self.kept = [FakeTensor(3 * MiB)]

        def __call__(self, *args):
            return None

        def method(self, *args):
            return None

    def with_closure(*args):
        return store

    def plain(*args):
        return acts  # noqa: F821 - a global it would append to

    inner = FakeModule({"w": FakeTensor(MiB)})
    inner._forward_hooks = {1: with_closure, 2: functools.partial(lambda box, *a: None, [FakeTensor(5 * MiB)])}
    inner._backward_hooks = {3: Keeper().method}
    model = FakeModule({}, {}, block=inner)
    model._forward_pre_hooks = {4: Keeper(), 5: plain}
    hooks = {hook.describe(): hook for hook in module_hooks(model, "model")}
    assert set(hooks) == {
        "forward hook test_hooks_of_every_kind_with_what_they_captured.<locals>.with_closure on model.block",
        "forward hook test_hooks_of_every_kind_with_what_they_captured.<locals>.<lambda> on model.block",
        "backward hook test_hooks_of_every_kind_with_what_they_captured.<locals>.Keeper.method on model.block",
        "forward pre-hook Keeper on model",
        "forward pre-hook test_hooks_of_every_kind_with_what_they_captured.<locals>.plain on model",
    }
    assert (
        "acts"
        in hooks[
            "forward pre-hook test_hooks_of_every_kind_with_what_they_captured.<locals>.plain on model"
        ].global_names
    )
    reach = walk(model, fake_probe(), root_name="model")
    assert reach.by_category()[ReachedAs.HOOKS] == (2 + 5 + 3 + 3) * MiB
    assert reach.by_category()[ReachedAs.PARAMETERS] == MiB


def test_paths_name_attributes_items_and_hooks():
    class Tracker:
        def __init__(self):
            self.history = {"loss": [FakeTensor(MiB)]}

    reach = walk(Tracker(), fake_probe(), root_name="tracker")
    (hit,) = reach.storages.values()
    assert describe_path("tracker", hit.path) == "tracker.history['loss']"
    assert describe_path("x", ((2, "forward hook f on model", -1),)) == "forward hook f on model"


def test_paths_name_what_functions_keep_in_defaults_and_closures():
    t, kept, keyword = FakeTensor(MiB), FakeTensor(2 * MiB), FakeTensor(3 * MiB)
    callbacks = [lambda x, t=t: x + t, _closing_over(kept), _keyword_default(keyword), _unfilled_cell()]
    reach = walk(callbacks, fake_probe(), root_name="callbacks")
    paths = sorted((hit.nbytes // MiB, describe_path("callbacks", hit.path)) for hit in reach.storages.values())
    assert paths == [
        (1, "callbacks[0].__defaults__[0]"),
        (2, "callbacks[1].__closure__[0].cell_contents"),
        (3, "callbacks[2].__kwdefaults__['t']"),
    ]


def test_a_function_keeps_nothing_of_its_globals_or_code():
    global _GLOBAL_TENSOR
    _GLOBAL_TENSOR = FakeTensor(MiB)  # a module's global, read by the function: the namespace's, not its own
    reach = walk(lambda: _GLOBAL_TENSOR, fake_probe(), root_name="f")
    assert reach.storages == {}


# -- the keys-only first pass of a walk of unchanged names --------------------------------------
class _Slotted:
    __slots__ = ("kept", "other")

    def __init__(self, kept, other=None):
        self.kept = kept
        self.other = other


class _Plain:
    def __init__(self, **attributes):
        self.__dict__.update(attributes)


def _full_union(roots, probe):
    keys = set()
    for name, value in roots:
        keys.update(walk(value, probe, root_name=name).storages)
    return keys


def _fake_roots():
    from tests.fakes import FakeOptimizer

    shared = FakeTensor(MiB)
    hooked = FakeTensor(2 * MiB)
    model = FakeModule({"w": FakeTensor(MiB, grad=FakeTensor(MiB))}, child=FakeModule({"b": FakeTensor(MiB)}))
    model._forward_hooks = {0: functools.partial(lambda kept, *a: None, [hooked])}
    model.cache = FakeTensor(3 * MiB)  # a plain attribute: out of the fingerprint's sight
    opt = FakeOptimizer(model.parameters())
    opt.step()
    return [
        ("t", FakeTensor(MiB, grad=FakeTensor(MiB))),
        ("cpu", FakeTensor(MiB, device="cpu")),
        ("nested", [1, "a", (shared, [FakeTensor(MiB)]), {"k": {"deeper": FakeTensor(MiB)}}]),
        ("tags", {frozenset({1, 2}), (FakeTensor(MiB),)}),
        ("slotted", _Slotted(FakeTensor(MiB), _Plain(inner=[shared.view()]))),
        ("model", model),
        ("opt", opt),
        ("error", ValueError(FakeTensor(MiB))),
        ("callbacks", [lambda x, t=FakeTensor(MiB): x, _closing_over(FakeTensor(MiB))]),
        ("scale", _keyword_default(FakeTensor(MiB))),
    ]


def _closing_over(tensor):
    def use(x):
        return x + tensor

    return use


def _keyword_default(tensor):
    return lambda x, *, t=tensor: x * t


def _unfilled_cell():
    def inner():
        return later

    return inner
    later = None  # never runs: ``later`` is a cell of ``inner`` that stays empty


def test_the_keys_only_pass_reaches_what_a_full_walk_of_each_root_reaches():
    from jupyter_cudamem.attribution.fast_walk import walk_together

    probe = fake_probe()
    roots = _fake_roots()
    together = walk_together(roots, probe)
    assert together.reached | set(together.late) == _full_union(roots, probe)
    assert not together.truncated
    callbacks, scale = dict(roots)["callbacks"], dict(roots)["scale"]
    captured = [callbacks[0].__defaults__[0], callbacks[1].__closure__[0].cell_contents, scale.__kwdefaults__["t"]]
    assert {probe.device_storage(tensor)[0] for tensor in captured} <= together.reached  # functions are walked
    # what modules keep out of sight is met last, with its owner and path: the hook's capture, model.cache
    late = {hit.owner: hit for hit in together.late.values()}
    assert [name for name, _ in roots][next(iter(late))] == "model"
    assert {hit.category for hit in together.late.values()} == {ReachedAs.HOOKS, ReachedAs.MODULE_ATTRIBUTES}


def test_the_keys_only_pass_follows_graphs_of_real_tensors():
    torch = pytest.importorskip("torch")
    from jupyter_cudamem.attribution.fast_walk import walk_together

    probe = torch_cpu_probe()
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64)
    loss = (x @ w).relu().pow(2).mean()
    roots = [("kept", {"history": [loss, (x @ w).tanh()]}), ("w", w), ("obj", _Slotted((x * 2).exp()))]
    together = walk_together(roots, probe)
    assert together.reached | set(together.late) == _full_union(roots, probe)
    assert len(together.reached) >= 6  # x, w, relu's and tanh's results, the exp, the slotted tensor


def test_the_keys_only_pass_stops_at_its_budget_and_says_so():
    from jupyter_cudamem.attribution.fast_walk import walk_together

    roots = [("many", [FakeTensor(MiB) for _ in range(100)])]
    together = walk_together(roots, fake_probe(), limit=20)
    assert together.truncated and len(together.reached) == 20
    assert not walk_together(roots, fake_probe(), limit=100).truncated


class _DuckTensor:
    """A tensor-like with what the walk needs as instance attributes only (no class-level grad_fn...)."""

    def __init__(self, nbytes, grad=None):
        from tests.fakes import FakeStorage

        self._storage = FakeStorage(nbytes)
        self.is_cuda = True
        self.grad = grad

    def untyped_storage(self):
        return self._storage


def test_the_keys_only_pass_reads_tensor_likes_without_pytorchs_class_attributes():
    from jupyter_cudamem.attribution import TensorProbe
    from jupyter_cudamem.attribution.fast_walk import walk_together
    from jupyter_cudamem.attribution.walk import walk

    probe = TensorProbe(tensor_types=(_DuckTensor,))
    roots = [("kept", [_DuckTensor(MiB, grad=_DuckTensor(2 * MiB))]), ("alone", _DuckTensor(MiB))]
    together = walk_together(roots, probe)
    union = set().union(*(walk(value, probe).storages for _, value in roots))
    assert together.reached == union and len(union) == 3


# -- the fast path against the specification ----------------------------------------------------------
def _walk_three_ways(roots, probe, monkeypatch, limit=None):
    """``walk_together`` as it runs (the fast path), with ``fast_lane`` handing every root back to
    ``collect_keys``' loop, and by the plain walk (``walk._Walker``, the specification) over the same
    roots with what modules keep out of sight walked last, as ``walk_together`` does."""
    from jupyter_cudamem.attribution import fast_walk
    from jupyter_cudamem.attribution import walk as walk_module
    from jupyter_cudamem.attribution.walk import ATOM_TYPES

    limit = walk_module.WALK_LIMIT if limit is None else limit
    fast = fast_walk.walk_together(roots, probe, limit=limit)
    with monkeypatch.context() as patched:
        patched.setattr(
            fast_walk._KeysOnlyWalker,
            "fast_lane",
            lambda self, values: [(owner, value, True) for owner, value in enumerate(values) if type(value) not in ATOM_TYPES],
        )
        loop = fast_walk.walk_together(roots, probe, limit=limit)
    names = [name for name, _ in roots]
    plain = walk_module._Walker(probe, frozenset(), True, limit, names, defer_hidden=True)
    return fast, loop, plain.run([value for _, value in roots])


def _late(reach):
    return {key: (hit.owner, hit.category, hit.path) for key, hit in reach.late.items()}


def _assert_same(fast, other):
    assert fast.reached == other.reached
    assert _late(fast) == _late(other)
    assert sorted(hook.describe() for hook in fast.hooks) == sorted(hook.describe() for hook in other.hooks)
    assert fast.truncated == other.truncated


class _Holder:
    def __init__(self, tensor, step=0):
        self.tensor = tensor
        self.step = step


class _NoDict:
    __slots__ = ()


class _OddDict:
    """An object whose ``__dict__`` is not a dict: the bulk read hands it back to the loop."""

    @property
    def __dict__(self):  # type: ignore[override]
        return [FakeTensor(MiB)]


def _mixed_roots():
    from collections import OrderedDict, deque, namedtuple

    shared_list = [FakeTensor(MiB), FakeTensor(MiB)]
    shared_tensor = FakeTensor(MiB)
    hooked = FakeTensor(2 * MiB)
    inner = FakeModule({"w": FakeTensor(MiB)})
    inner._forward_hooks = {0: functools.partial(lambda kept, *a: None, [hooked])}
    inner.cache = FakeTensor(3 * MiB)
    pair = namedtuple("pair", "a b")
    cycle: list = [FakeTensor(MiB)]
    cycle.append(cycle)
    return [
        ("flat", [FakeTensor(MiB), 3, "x", None]),
        ("same_list_again", shared_list),
        ("shared_list", shared_list),
        ("twice_in_one", [shared_list, shared_list, shared_tensor, shared_tensor]),
        ("ordered", OrderedDict(a=FakeTensor(MiB), b=[FakeTensor(MiB), {"c": shared_tensor}])),
        ("queue", deque([FakeTensor(MiB), pair(FakeTensor(MiB), 1)])),
        ("holder", _Holder(FakeTensor(MiB, grad=FakeTensor(MiB)))),
        ("holders", [_Holder(FakeTensor(MiB)) for _ in range(5)]),
        ("trainer", _Holder({"model": inner, "history": [FakeTensor(MiB)]})),  # a module below the roots
        ("slotted", _Slotted(FakeTensor(MiB), _Plain(inner=[shared_tensor]))),
        ("dictless", [_NoDict(), len, int, object()]),
        ("odd", _OddDict()),
        ("cycle", cycle),
        ("tags", {frozenset({1, 2}), (FakeTensor(MiB),)}),
        ("atom", 5),
        ("cpu", FakeTensor(MiB, device="cpu", grad=FakeTensor(MiB))),
        ("callbacks", [lambda x, t=FakeTensor(MiB): x, lambda x, t=shared_tensor: x, _closing_over(shared_list)]),
        ("nested_functions", _closing_over(_keyword_default(FakeTensor(MiB)))),
        ("empty_cell", _unfilled_cell()),
        ("bound", [
            _Holder(FakeTensor(MiB)).__init__,
            functools.partial(_closing_over, FakeTensor(MiB), k=shared_tensor),
        ]),
    ]


def test_the_fast_path_reaches_what_the_plain_walk_reaches_with_the_same_owners(monkeypatch):
    for roots in (_fake_roots(), _mixed_roots(), _fake_roots() + _mixed_roots()):
        fast, loop, plain = _walk_three_ways(roots, fake_probe(), monkeypatch)
        _assert_same(fast, plain)
        _assert_same(loop, plain)
    # functions below the roots (in a list, in another function's closure) are walked by all three
    roots = _mixed_roots()
    nested = dict(roots)["nested_functions"].__closure__[0].cell_contents.__kwdefaults__["t"]
    fast, _, _ = _walk_three_ways(roots, fake_probe(), monkeypatch)
    assert fake_probe().device_storage(nested)[0] in fast.reached
    # the module under ``trainer`` keeps a hook's capture and a plain attribute: named by that root
    roots = _mixed_roots()
    fast, _, _ = _walk_three_ways(roots, fake_probe(), monkeypatch)
    owners = {roots[hit.owner][0] for hit in fast.late.values()}
    assert owners == {"trainer"}


def test_the_fast_path_counts_each_object_as_the_plain_walk_does(monkeypatch):
    """Same count per object queued: all three ways are cut at the same limit, and by it alone."""
    roots = _mixed_roots()
    fast, loop, plain = _walk_three_ways(roots, fake_probe(), monkeypatch)
    assert not fast.truncated and not loop.truncated and not plain.truncated
    cut = {}
    for limit in range(1, 80):
        fast, loop, plain = _walk_three_ways(roots, fake_probe(), monkeypatch, limit=limit)
        assert fast.truncated == loop.truncated == plain.truncated, limit
        cut[limit] = fast.truncated
    assert cut[1] and not cut[79]  # the test spans the limit where the walk stops being cut


def test_the_fast_path_over_real_tensors_with_graphs_and_gradients(monkeypatch):
    torch = pytest.importorskip("torch")
    probe = torch_cpu_probe()
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(8, 16)
    (x @ w).sum().backward()  # w.grad
    kept = (x @ w).tanh()
    kept.retain_grad()
    kept.sum().backward()
    sparse = torch.randn(4, 4).to_sparse()  # no single storage: the bulk read hands its part back
    model = torch.nn.Linear(4, 4)
    stored = []
    model.register_forward_hook(lambda module, args, out: stored.append(out))
    model(torch.randn(2, 4))
    roots = [
        ("w", w),
        ("values", [x, kept, {"loss": (x @ w).pow(2).mean()}, [w.grad]]),
        ("sparse", [sparse, torch.zeros(3)]),
        ("objects", [_Holder(x * 2) for _ in range(3)]),
        ("wrapped", _Holder(model)),
        ("params", list(model.parameters())),
    ]
    fast, loop, plain = _walk_three_ways(roots, probe, monkeypatch)
    _assert_same(fast, plain)
    _assert_same(loop, plain)
    assert len(fast.reached) >= 10 and fast.late  # the hook's outputs are met late, under ``wrapped``


def test_a_bound_method_keeps_its_object_and_a_partial_its_arguments():
    class Saver:
        def __init__(self, kept):
            self.kept = kept

        def save(self, x):
            return x

    hooks = [Saver(FakeTensor(MiB)).save, functools.partial(lambda x, w: x, w=FakeTensor(2 * MiB))]
    hooks.append(functools.partial(print, FakeTensor(3 * MiB)))
    reach = walk(hooks, fake_probe(), root_name="hooks")
    paths = sorted((hit.nbytes // MiB, describe_path("hooks", hit.path)) for hit in reach.storages.values())
    assert paths == [(1, "hooks[0].__self__"), (2, "hooks[1].keywords['w']"), (3, "hooks[2].args[0]")]
