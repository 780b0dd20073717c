"""What a cell left behind, named: leaks through autograd graphs, hooks, the output cache and tracebacks,
and results that are not leaks, with the advice for each. Real CPU tensors stand for device tensors
(``torch_cpu_probe``): autograd graphs and hooks are the same Python structures on every device."""

from __future__ import annotations

import pytest

from jupyter_cudamem.attribution.left_records import Cause, Change
from jupyter_cudamem.attribution.holders import HolderKind, Origin, Reference
from jupyter_cudamem.attribution.left import MIN_HOLDER_BYTES, left_behind
from jupyter_cudamem.attribution.snapshot import NamespaceSnapshot
from tests.fakes import FakeModule, FakeOptimizer, FakeTensor, MiB, fake_probe, torch_cpu_probe

torch = pytest.importorskip("torch")

B, H = 64, 1024  # a batch of 64 rows through a 1024-wide layer: one activation is 256 KiB
ACTIVATION = B * H * 4
SETUP = """
import torch
torch.manual_seed(0)
x = torch.randn(B, 256)
W = torch.randn(256, H, requires_grad=True)
def step():
    return (x @ W).relu().pow(2).mean()   # keeps relu's result (one activation) and a scalar
"""


def namespace(**extra):
    ns = {"B": B, "H": H, **extra}
    exec(SETUP, ns)
    return ns


def run(ns, code, left_bytes, probe=None, refs_before=(), refs_after=()):
    """Snapshot, run ``code`` as a cell in ``ns``, and attribute ``left_bytes``."""
    probe = probe or torch_cpu_probe()
    before = NamespaceSnapshot.take(ns, refs_before, probe)
    exec(code, ns)
    return left_behind(ns, refs_after, before, left_bytes, probe)


def only(left, name):
    found = [h for h in left.holders if h.name == name]
    assert len(found) == 1, [h.name for h in left.holders]
    return found[0]


def test_losses_kept_in_a_list_are_their_graphs():
    ns = namespace(losses=[])
    expected = 40 * (ACTIVATION + 4)
    left = run(ns, "for _ in range(40):\n    losses.append(step())", expected)
    losses = only(left, "losses")
    assert losses.leak and losses.cause is Cause.GRAPH and losses.change is Change.GREW
    assert losses.nbytes == expected and losses.graph_bytes == 40 * ACTIVATION
    assert losses.tensors == 40 and losses.graph_tensors == 40 and losses.scalar_graph_tensors == 40
    assert losses.description == "list of 40 tensors holding their autograd graphs, 10.00 MiB of saved activations"
    assert "loss.item()" in losses.advice[0] and "del losses" in losses.advice[1]
    assert left.remainder_bytes == 0 and [h.name for h in left.holders] == ["losses"]
    # x and W (what the graphs also saved: the input and the weight) were there before: not counted.
    assert all(h.name not in ("x", "W") for h in left.holders)


def test_a_second_run_counts_only_what_it_added():
    ns = namespace(losses=[])
    run(ns, "for _ in range(40):\n    losses.append(step())", 40 * (ACTIVATION + 4))
    left = run(ns, "for _ in range(20):\n    losses.append(step())", 20 * (ACTIVATION + 4))
    losses = only(left, "losses")
    assert losses.nbytes == 20 * (ACTIVATION + 4) and losses.tensors == 20


def test_a_summed_loss_chains_every_step_graph():
    ns = namespace()
    left = run(ns, "total = 0\nfor _ in range(40):\n    total = total + step()", 40 * ACTIVATION)
    total = only(left, "total")
    assert total.cause is Cause.GRAPH and total.kind is HolderKind.TENSOR and total.change is Change.NEW
    assert total.graph_bytes == 40 * ACTIVATION  # the chain of Add nodes reaches all 40 steps' graphs
    assert total.description.startswith("tensor (), torch.float32 holding its autograd graph")
    assert "total += value.item()" in total.advice[0]


def test_a_metric_accumulated_without_item_in_a_training_loop():
    # backward() frees the loss's saved tensors, but not those of a metric it never went through.
    ns = namespace()
    code = """
opt = torch.optim.SGD([W], lr=0.0)
target = torch.zeros(B, H)
running_mae = 0.0
for _ in range(20):
    out = x @ W
    loss = (out - target).pow(2).mean()
    loss.backward(); opt.step(); opt.zero_grad()
    running_mae += (out - target).abs().mean()   # abs keeps its input: one activation per step
"""
    left = run(ns, code, 20 * ACTIVATION + 2 * ACTIVATION)
    metric = only(left, "running_mae")
    assert metric.cause is Cause.GRAPH and metric.graph_bytes == 20 * ACTIVATION
    assert "running_mae += value.item()" in metric.advice[0]


def test_a_training_step_keeping_its_output_is_not_a_leak():
    # backward() freed what the graph saved: ``out`` holds only itself, the gradients are W's.
    ns = namespace()
    code = "out = (torch.randn(8 * B, 256) @ W).relu()\nloss = out.pow(2).mean()\nloss.backward()"
    left = run(ns, code, 8 * ACTIVATION + 4 * H * 256)
    assert not left.has_leak, [(h.name, h.cause) for h in left.holders]
    assert only(left, "out").cause is Cause.DATA and only(left, "W").cause is Cause.GRADIENTS


def test_outputs_cached_in_a_dict_advise_no_grad():
    # each output keeps its graph, and the graph the activation before it (pow saved relu's output)
    ns = namespace(cache={})
    left = run(ns, "for i in range(8):\n    cache[i] = (x @ W).relu().pow(2)", 16 * ACTIVATION)
    cache = only(left, "cache")
    assert cache.cause is Cause.GRAPH and cache.kind is HolderKind.DICT
    assert cache.description.startswith("dict of 8 tensors holding their autograd graphs")
    assert "torch.no_grad()" in cache.advice[0] and "inference_mode" in cache.advice[0]


def test_a_forward_hook_appending_to_a_notebook_list_is_named():
    ns = namespace(acts=[])
    exec("model = torch.nn.Sequential(torch.nn.Linear(256, H), torch.nn.ReLU())", ns)
    code = "handle = model[0].register_forward_hook(lambda m, i, o: acts.append(o))\nfor _ in range(8):\n    model(x)"
    left = run(ns, code, 8 * ACTIVATION)
    acts = only(left, "acts")
    assert acts.cause is Cause.HOOK and acts.leak and acts.nbytes == 8 * ACTIVATION
    assert acts.hooks == ("forward hook <lambda> on model.0",)
    assert "handle.remove()" in acts.advice[0] and "output.detach()" in acts.advice[0]


def test_a_hook_keeping_outputs_in_its_closure_is_counted_as_likely():
    ns = namespace()
    exec(
        "model = torch.nn.Sequential(torch.nn.Linear(256, H), torch.nn.ReLU())\n"
        "def keeper():\n    kept = []\n"
        "    def save(module, inputs, output):\n        kept.append(output)\n    return save\n"
        "handle = model[1].register_forward_hook(keeper())",
        ns,
    )
    left = run(ns, "for _ in range(8):\n    model(x)", 8 * ACTIVATION)
    model = only(left, "model")
    assert model.cause is Cause.HOOK and model.likely and model.change is Change.UNCHANGED
    assert model.nbytes == 8 * ACTIVATION
    assert model.where == "forward hook keeper.<locals>.save on model.1"
    assert "forward hook keeper.<locals>.save on model.1" in model.advice[0]
    assert model.advice[1].startswith("removing the hook frees what it kept")  # not "del model"


def test_a_hook_storing_into_its_objects_attribute():
    ns = namespace()
    exec(
        "model = torch.nn.Sequential(torch.nn.Linear(256, H))\n"
        "class Saver:\n    def __init__(self):\n        self.outputs = []\n"
        "    def hook(self, module, inputs, output):\n        self.outputs.append(output)\n"
        "saver = Saver()\nmodel[0].register_forward_hook(saver.hook)",
        ns,
    )
    left = run(ns, "for _ in range(6):\n    model(x)", 6 * ACTIVATION)
    saver = only(left, "saver")
    assert saver.cause is Cause.HOOK and saver.where == "saver.outputs" and saver.nbytes == 6 * ACTIVATION
    assert saver.hooks == ("forward hook Saver.hook on model.0",)


def test_the_output_cache_and_a_traceback_are_named_as_such():
    ns = namespace()
    value = torch.randn(2 * MiB // 4)

    def failing():
        kept = torch.empty(2 * MiB // 4)  # noqa: F841 - a local the traceback keeps
        raise RuntimeError("boom")

    try:
        failing()
    except RuntimeError as error:
        exc = error
    old = torch.ones(MiB)  # an Out entry from before the cell: not what the cell left
    refs = [
        Reference("Out[3]", Origin.OUTPUT_CACHE, value),
        Reference("_", Origin.OUTPUT_CACHE, value),
        Reference("Out[1]", Origin.OUTPUT_CACHE, old),
        Reference("sys.last_value", Origin.EXCEPTION, exc),
        Reference("failing()", Origin.FRAME, exc.__traceback__.tb_next.tb_frame),
    ]
    left = run(ns, "pass", 4 * MiB, refs_before=refs[2:3], refs_after=refs)
    out = only(left, "Out[3] / _")
    assert out.cause is Cause.OUTPUT_CACHE and out.leak and out.nbytes == 2 * MiB
    assert "%reset -f out" in out.advice[0]
    tb = only(left, "sys.last_value")
    assert tb.cause is Cause.TRACEBACK and tb.nbytes == 2 * MiB and "%oomfix" in tb.advice[0]
    assert all("Out[1]" not in h.name for h in left.holders)
    del exc, refs


def test_results_are_not_leaks_model_dataset_and_adams_first_step():
    ns = namespace()
    left = run(ns, "model = torch.nn.Linear(1024, 1024)", 1024 * 1024 * 4 + 4096)
    model = only(left, "model")
    assert not model.leak and model.cause is Cause.MODEL and model.description.startswith("Linear: parameters 4.00 MiB")

    left = run(ns, "X = torch.randn(8192, 256)", 8192 * 256 * 4)
    data = only(left, "X")
    assert not data.leak and data.cause is Cause.DATA and "expected" in data.advice[0]

    exec("opt = torch.optim.Adam(model.parameters())", ns)
    left = run(ns, "model(torch.randn(8, 1024)).sum().backward()\nopt.step()", 3 * (4 * MiB + 4096))
    assert not left.has_leak
    assert only(left, "opt").cause is Cause.OPTIMIZER_STATE and only(left, "opt").change is Change.CHANGED
    assert only(left, "model").cause is Cause.GRADIENTS
    # A second step adds no state and no gradients: nothing left to name.
    left = run(ns, "model(torch.randn(8, 1024)).sum().backward()\nopt.step()", 0)
    assert left.holders == ()


def test_a_module_moved_in_place_is_new_memory_of_an_unchanged_name():
    w = FakeTensor(8 * MiB, device="cpu")
    model = FakeModule({"w": w})
    ns = {"model": model}
    before = NamespaceSnapshot.take(ns, (), fake_probe())
    model._parameters["w"] = FakeTensor(8 * MiB)  # what .cuda() does: same module, parameters on the device
    left = left_behind(ns, (), before, 8 * MiB, fake_probe())
    assert only(left, "model").cause is Cause.MODEL and only(left, "model").nbytes == 8 * MiB


def test_what_no_name_reaches_is_the_remainder_and_small_holders_are_summed():
    ns = {"big": None, "tiny": None}
    before = NamespaceSnapshot.take(ns, (), fake_probe())
    ns.update(big=FakeTensor(100 * MiB), tiny=FakeTensor(MIN_HOLDER_BYTES // 2))
    left = left_behind(ns, (), before, 130 * MiB, fake_probe())
    assert [h.name for h in left.holders] == ["big"]
    assert left.smaller_bytes == MIN_HOLDER_BYTES // 2 and left.smaller_count == 1
    assert left.remainder_bytes == 30 * MiB - MIN_HOLDER_BYTES // 2


def test_shared_storages_belong_to_one_holder_and_name_the_others():
    ns = {}
    before = NamespaceSnapshot.take(ns, (), fake_probe())
    out = FakeTensor(10 * MiB)
    ns.update(out=out, history=[out])
    left = left_behind(ns, (), before, 10 * MiB, fake_probe())
    assert len(left.holders) == 1 and left.attributed_bytes == 10 * MiB
    holder = left.holders[0]
    assert set(holder.also) | {holder.name} == {"out", "history"}
    assert "del history, out" in holder.advice[-1] or "del out, history" in holder.advice[-1]


def test_optimizer_state_of_fakes_and_its_parameters_stay_the_models():
    w = FakeTensor(16 * MiB)
    model = FakeModule({"w": w})
    opt = FakeOptimizer(model.parameters())
    ns = {"model": model, "opt": opt}
    before = NamespaceSnapshot.take(ns, (), fake_probe())
    opt.step()
    left = left_behind(ns, (), before, 32 * MiB, fake_probe())
    assert [(h.name, h.cause, h.nbytes) for h in left.holders] == [("opt", Cause.OPTIMIZER_STATE, 32 * MiB)]


def test_checkpointed_graphs_are_not_recomputed_by_the_walk():
    from torch.utils.checkpoint import checkpoint

    ns = namespace(calls=[0])
    exec("def block(v):\n    calls[0] += 1\n    return (v @ W).relu()", ns)
    ns["checkpoint"] = checkpoint
    left = run(ns, "y = checkpoint(block, x, use_reentrant=False).sum()", ACTIVATION)
    assert ns["calls"] == [1]  # only the forward itself ran block
    assert left.holders == () or all(h.name == "y" for h in left.holders)


def test_custom_function_context_and_saved_tensors_are_counted():
    ns = namespace()
    exec(
        "class Scale(torch.autograd.Function):\n"
        "    @staticmethod\n    def forward(ctx, a):\n"
        "        ctx.save_for_backward(a * 2)\n        ctx.extra = a * 3\n        return a * 4\n"
        "    @staticmethod\n    def backward(ctx, g):\n        return g\n",
        ns,
    )
    left = run(ns, "y = Scale.apply((x @ W).relu())", 4 * ACTIVATION)
    y = only(left, "y")
    # its own storage, the saved a*2, ctx.extra and relu's saved result
    assert y.nbytes == 4 * ACTIVATION and y.graph_bytes == 3 * ACTIVATION


def test_a_huge_graph_is_walked_within_the_bound(monkeypatch):
    from jupyter_cudamem.attribution import left as left_module

    monkeypatch.setattr(left_module, "walk", _bounded_walk(500))
    ns = namespace()
    left = run(ns, "t = W.sum()\nfor _ in range(2000):\n    t = t + W.sum()", 0)
    assert left.truncated


def _bounded_walk(limit):
    from jupyter_cudamem.attribution.walk import walk

    def bounded(*args, **kwargs):
        kwargs["limit"] = limit
        return walk(*args, **kwargs)

    return bounded


def test_without_torch_there_is_nothing_to_attribute(monkeypatch):
    import sys

    monkeypatch.delitem(sys.modules, "torch", raising=False)
    snapshot = NamespaceSnapshot.take({"x": 1})
    assert snapshot.names == {}
    assert left_behind({"x": 1}, (), snapshot, MiB).holders == ()


def test_memory_an_unchanged_container_holds_deep_down_is_old_when_a_new_name_reaches_it():
    """Unchanged names are walked by a keys-only pass: what they reach, however deep, still makes a
    new name's alias of it old, and a new tensor beside it new."""
    probe = fake_probe()
    deep = FakeTensor(8 * MiB)
    ns = {f"v{index}": [FakeTensor(MiB // 16), index] for index in range(2000)}
    ns["data"] = {"runs": [(1, {"kept": _Holder(deep)})]}
    before = NamespaceSnapshot.take(ns, (), probe)
    ns["alias"] = [deep.view()]  # new name, old memory
    ns["fresh"] = [deep.view(), FakeTensor(4 * MiB)]  # new name: one old storage, one new
    left = left_behind(ns, (), before, 4 * MiB, probe)
    assert [h.name for h in left.holders] == ["fresh"] and left.holders[0].nbytes == 4 * MiB
    assert left.remainder_bytes == 0 and not left.truncated


class _Holder:
    def __init__(self, tensor):
        self.tensor = tensor


def test_attributing_holds_off_the_garbage_collector_and_restores_it():
    import gc

    from jupyter_cudamem.attribution import left as left_module

    seen = []
    real = left_module.judge_namespace

    def judge(*args):
        seen.append(gc.isenabled())
        return real(*args)

    probe = fake_probe()
    ns = {"t": FakeTensor(MiB)}
    before = NamespaceSnapshot.take(ns, (), probe)
    original = left_module.judge_namespace
    left_module.judge_namespace = judge
    try:
        assert gc.isenabled()
        left_behind(ns, (), before, MiB, probe)
        assert seen == [False] and gc.isenabled()
        gc.disable()
        left_behind(ns, (), before, MiB, probe)
        assert not gc.isenabled()  # left as it was found
    finally:
        gc.enable()
        left_module.judge_namespace = original


# -- growth inside a container or object that is the same object before and after ---------------
def test_a_list_grown_inside_an_unchanged_dict_is_named_by_its_path():
    ns = namespace(history={"losses": [], "epoch": 0})
    expected = 40 * (ACTIVATION + 4)
    left = run(ns, "for _ in range(40):\n    history['losses'].append(step())", expected)
    losses = only(left, "history['losses']")
    assert losses.leak and losses.cause is Cause.GRAPH
    assert losses.change is Change.GREW and losses.kind is HolderKind.LIST
    assert losses.nbytes == expected and losses.graph_tensors == 40
    assert losses.description == "list of 40 tensors holding their autograd graphs, 10.00 MiB of saved activations"
    assert "loss.item()" in losses.advice[0] and "history['losses']" in losses.advice[0]
    assert left.remainder_bytes == 0 and [h.name for h in left.holders] == ["history['losses']"]
    # run again: only what the second run appended
    left = run(ns, "for _ in range(10):\n    history['losses'].append(step())", 10 * (ACTIVATION + 4))
    assert only(left, "history['losses']").nbytes == 10 * (ACTIVATION + 4)


def test_tensors_added_to_a_dict_inside_an_unchanged_dict_and_a_list_inside_a_list():
    ns = namespace(state={"acts": {}, "step": 0}, runs=[[], []])
    # pow saves its input: each entry keeps relu's result (an activation) through its graph
    left = run(ns, "for i in range(6):\n    state['acts'][i] = (x @ W).relu().pow(2)", 12 * ACTIVATION)
    acts = only(left, "state['acts']")
    assert acts.leak and acts.cause is Cause.GRAPH and acts.kind is HolderKind.DICT and acts.nbytes == 12 * ACTIVATION
    left = run(ns, "for _ in range(6):\n    runs[1].append(step())", 6 * (ACTIVATION + 4))
    assert only(left, "runs[1]").nbytes == 6 * (ACTIVATION + 4)


def test_an_object_attribute_grown_in_place_names_its_path_in_the_advice():
    ns = namespace()
    exec("class Tracker:\n    def __init__(self):\n        self.outputs = []\n        self.name = 'run'\n"
         "tracker = Tracker()", ns)
    left = run(ns, "for _ in range(8):\n    tracker.outputs.append(step())", 8 * (ACTIVATION + 4))
    tracker = only(left, "tracker")
    assert tracker.cause is Cause.GRAPH
    assert tracker.where == "tracker.outputs" and tracker.nbytes == 8 * (ACTIVATION + 4)
    assert "tracker.outputs" in tracker.advice[0]


def test_results_kept_inside_an_unchanged_dict_are_not_leaks():
    ns = namespace(results={"preds": []}, models={})
    left = run(ns, "with torch.no_grad():\n    for _ in range(4):\n        results['preds'].append((x @ W).relu())",
               4 * ACTIVATION)
    preds = only(left, "results['preds']")
    assert not preds.leak and preds.cause is Cause.DATA and "gained 4 tensors" in preds.advice[0]
    left = run(ns, "models['main'] = torch.nn.Linear(1024, 1024)", 1024 * 1024 * 4 + 4096)
    assert not left.has_leak and [(h.name, h.cause) for h in left.holders] == [("models", Cause.MODEL)]


def test_a_child_that_shrank_or_was_replaced_is_judged_by_what_it_holds_now():
    probe = fake_probe()
    old = [FakeTensor(8 * MiB) for _ in range(3)]
    history = {"losses": list(old), "best": [FakeTensor(8 * MiB)]}
    ns = {"history": history}
    before = NamespaceSnapshot.take(ns, (), probe)
    history["losses"].pop()  # shrank: what stays was there before
    history["best"] = [FakeTensor(16 * MiB)]  # replaced by a new list: all it holds is new
    left = left_behind(ns, (), before, 16 * MiB, probe)
    assert [(h.name, h.nbytes, h.change) for h in left.holders] == [("history['best']", 16 * MiB, Change.GREW)]
    assert left.remainder_bytes == 0

    before = NamespaceSnapshot.take(ns, (), probe)
    history["losses"].clear()  # only shrank: nothing new, nothing named
    left = left_behind(ns, (), before, 8 * MiB, probe)
    assert left.holders == () and left.remainder_bytes == 8 * MiB


def test_a_defaultdict_of_lists_grown_in_place_and_growth_in_two_children():
    import collections

    probe = fake_probe()
    history = collections.defaultdict(list)
    history["train"].append(FakeTensor(MiB))
    history["val"].append(FakeTensor(MiB))
    ns = {"history": history}
    before = NamespaceSnapshot.take(ns, (), probe)
    history["train"].append(FakeTensor(32 * MiB))
    left = left_behind(ns, (), before, 32 * MiB, probe)
    assert [(h.name, h.nbytes) for h in left.holders] == [("history['train']", 32 * MiB)]
    before = NamespaceSnapshot.take(ns, (), probe)
    history["train"].append(FakeTensor(32 * MiB))
    history["val"].append(FakeTensor(32 * MiB))  # two children grew: the dict is the holder
    left = left_behind(ns, (), before, 64 * MiB, probe)
    assert [(h.name, h.nbytes, h.change) for h in left.holders] == [("history", 64 * MiB, Change.GREW)]


def test_the_rest_of_the_namespace_is_walked_only_when_the_new_names_do_not_account_for_what_was_left(monkeypatch):
    """On a large namespace the walk of every unchanged name is most of the cost: it is skipped when the
    new storages under the changed names account for all the cell left (less than 512 bytes a storage
    short, PyTorch's rounding), and made otherwise: memory held out of sight, or a storage counted as new
    that an unchanged name holds (the graphs below save ``W``, which is old)."""
    from jupyter_cudamem.attribution import left as left_module

    walks = []
    real = left_module.walk_together

    def counting(roots, *args, **kwargs):
        walks.append(len(roots))
        return real(roots, *args, **kwargs)

    monkeypatch.setattr(left_module, "walk_together", counting)
    bystanders = {f"v{i}": torch.zeros(16) for i in range(50)}
    ns = namespace(kept=[], **bystanders)
    code = "kept.append(torch.ones(16 * B, H))"  # 4 MiB
    found = run(ns, code, 16 * ACTIVATION)  # exactly what the new item holds
    assert only(found, "kept").nbytes == 16 * ACTIVATION and len(walks) == 1  # the unchanged modules only (none)
    walks.clear()
    found = run(ns, code, 16 * ACTIVATION + 8 * MiB)  # 8 MiB no name holds: everything is walked
    assert only(found, "kept").nbytes == 16 * ACTIVATION and len(walks) == 2 and walks[1] >= 50
    walks.clear()
    found = run(ns, "losses = [step() for _ in range(4)]", 4 * (ACTIVATION + 4))  # graphs save W (old)
    assert len(walks) == 2 and only(found, "losses").nbytes == 4 * (ACTIVATION + 4)


# -- what functions keep: default arguments and closure cells --------------------------------------------
MAT = 1024 * 1024 * 4  # one float32 tensor of 1024 x 1024: 4 MiB


def test_tensors_kept_in_lambdas_default_arguments_are_named_by_the_expression_that_reads_them():
    ns = namespace(callbacks=[])
    code = "for i in range(3):\n    t = torch.randn(1024, 1024)\n    callbacks.append(lambda y, t=t: y + t)\ndel t"
    left = run(ns, code, 3 * MAT)
    callbacks = only(left, "callbacks")
    assert callbacks.nbytes == 3 * MAT and callbacks.change is Change.GREW
    assert callbacks.description == "list of 3 functions keeping 3 tensors in their default arguments"
    assert callbacks.where == "callbacks[0].__defaults__[0], and the same in 2 more"
    assert ns["callbacks"][0].__defaults__[0].nbytes == MAT  # the expression reads what it names
    assert left.remainder_bytes == 0


def test_a_nested_function_closing_over_a_tensor_is_a_holder_of_its_own():
    ns = namespace()
    code = (
        "def make_scaler():\n    scale = torch.randn(1024, 1024)\n"
        "    def apply(y):\n        return y * scale\n    return apply\n"
        "scaler = make_scaler()"
    )
    left = run(ns, code, MAT)
    scaler = only(left, "scaler")
    assert scaler.nbytes == MAT and scaler.change is Change.NEW
    assert scaler.description == "function make_scaler.<locals>.apply keeping 1 tensor in its closure (scale)"
    assert scaler.where == "scaler.__closure__[0].cell_contents"


def test_a_keyword_only_default_in_a_dict_of_functions():
    ns = namespace(transforms={})
    left = run(ns, "w = torch.randn(1024, 1024)\ntransforms['mix'] = lambda y, *, w=w: y @ w\ndel w", MAT)
    transforms = only(left, "transforms")
    assert transforms.description == "dict of 1 function keeping 1 tensor in its default arguments"
    assert transforms.where == "transforms['mix'].__kwdefaults__['w']"


def test_a_bound_method_of_an_object_no_name_keeps_is_named_by_its_self():
    ns = namespace(handlers=[])
    exec("class Scaler:\n    def __init__(self):\n        self.scale = torch.randn(1024, 1024)\n"
         "    def apply(self, y):\n        return y * self.scale\n", ns)
    left = run(ns, "handlers.append(Scaler().apply)", MAT)
    handlers = only(left, "handlers")
    assert handlers.description == "list of 1 function keeping 1 tensor in its bound object"
    assert handlers.where == "handlers[0].__self__"
