"""``sources.torch_breakdown``: the tracker over real CPU tensors and modules (``PeakTracker(ns, "cpu")``).

The model: ``Sequential(Linear(256, 1024), ReLU(), Linear(1024, 256))``, float32, on a batch of 512.
By hand: the first Linear holds 256*1024 + 1024 = 263,168 parameters (1,052,672 bytes), the second
1024*256 + 256 = 262,400 (1,049,600 bytes); 2,102,272 bytes in all. AdamW keeps two moments per
parameter and a 4-byte step counter per parameter tensor (4 of them, on the CPU here): 4,204,560 bytes.
The ReLU's output is 512 x 1024 floats: 2,097,152 bytes.
"""

from __future__ import annotations

import gc
import weakref

import pytest

torch = pytest.importorskip("torch")

from jupyter_cudamem.breakdown import Category, Phase  # noqa: E402
from jupyter_cudamem.sources.torch_breakdown import PeakTracker, model_state_bytes  # noqa: E402

FIRST, SECOND = 1_052_672, 1_049_600
STATE = 2 * (FIRST + SECOND) + 4 * 4
RELU_OUT = 512 * 1024 * 4


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))


def by_category(peak):
    totals = dict.fromkeys(Category, 0)
    for (category, _), size in peak.held.items():
        totals[category] += size
    return totals


def by_module(peak, category):
    return {module: size for (c, module), size in peak.held.items() if c is category and size}


def test_a_training_loop_is_tracked_by_category_module_and_phase():
    ns = {"model": mlp()}
    ns["optimizer"] = torch.optim.AdamW(ns["model"].parameters(), foreach=True)
    with PeakTracker(ns, "cpu") as tracker:
        for _ in range(3):  # MemTracker stops at the second call of the model; this must not
            x = torch.randn(512, 256)
            ns["model"](x).pow(2).mean().backward()
            ns["optimizer"].step()
            ns["optimizer"].zero_grad()
    peak = tracker.peaks()["cpu"]
    totals = by_category(peak)
    assert totals[Category.PARAMETERS] == FIRST + SECOND
    assert by_module(peak, Category.PARAMETERS) == {"model.0": FIRST, "model.2": SECOND}
    assert totals[Category.OPTIMIZER_STATE] == STATE
    # The peak is in backward, after the last layer's gradients landed and before the first layer's:
    # the ReLU's output is still kept for backward, and two gradients of it as large are temporaries.
    assert peak.phase is Phase.BACKWARD
    assert by_module(peak, Category.GRADIENTS) == {"model.2": SECOND}
    assert by_module(peak, Category.ACTIVATIONS) == {"model.1": RELU_OUT}
    assert totals[Category.TEMPORARIES] == 2 * RELU_OUT
    assert peak.models == ("model",)
    # zero_grad(set_to_none=True) left no gradient at the end: the expected figures are the end state's
    assert peak.expected == {Category.PARAMETERS: FIRST + SECOND, Category.GRADIENTS: 0, Category.OPTIMIZER_STATE: STATE}


def test_inference_without_autograd_keeps_no_activations():
    ns = {"model": mlp()}
    with PeakTracker(ns, "cpu") as tracker:
        with torch.no_grad():
            ns["model"](torch.randn(512, 256))
    peak = tracker.peaks()["cpu"]
    totals = by_category(peak)
    assert totals[Category.ACTIVATIONS] == 0 and totals[Category.GRADIENTS] == 0
    assert totals[Category.PARAMETERS] == FIRST + SECOND
    # the Linear's output and the ReLU's (a new tensor: ReLU is not in place) are alive together
    assert totals[Category.TEMPORARIES] == 2 * RELU_OUT
    assert peak.phase is Phase.FORWARD


def test_models_built_in_the_cell_are_found_whether_run_or_not():
    ns = {}
    with PeakTracker(ns, "cpu") as tracker:
        ns["a"] = torch.nn.Linear(256, 1024)
        ns["b"] = torch.nn.Linear(1024, 256)  # built, never run
        ns["a"](torch.randn(8, 256)).sum().backward()
    peak = tracker.peaks()["cpu"]
    assert by_module(peak, Category.PARAMETERS) == {"a": FIRST, "b": SECOND}
    assert by_module(peak, Category.GRADIENTS) == {"a": FIRST}
    assert set(peak.models) == {"a", "b"}


def test_the_step_temporaries_are_not_optimizer_state():
    ns = {"model": mlp()}
    ns["optimizer"] = torch.optim.SGD(ns["model"].parameters(), lr=0.1, momentum=0.9, foreach=True)
    with PeakTracker(ns, "cpu") as tracker:
        for _ in range(2):
            ns["optimizer"].zero_grad(set_to_none=False)
            ns["model"](torch.randn(4, 256)).sum().backward()
            ns["optimizer"].step()
    peak = tracker.peaks()["cpu"]
    totals = by_category(peak)
    # SGD's momentum buffer: one per parameter, as large as it; no step counter
    assert totals[Category.OPTIMIZER_STATE] == FIRST + SECOND
    assert totals[Category.GRADIENTS] == FIRST + SECOND


def test_the_tracker_keeps_no_tensor_alive():
    ns = {"model": mlp()}
    with PeakTracker(ns, "cpu") as tracker:
        made = torch.randn(1024, 1024)
        alive = weakref.ref(made)
        ns["model"](torch.randn(2, 256))
    del made
    gc.collect()
    assert alive() is None
    assert tracker.peaks()["cpu"].held  # the records stay, as sizes


def test_hooks_are_removed_on_exit():
    from torch.nn.modules import module as nn_module

    before = len(nn_module._global_forward_pre_hooks)
    model = mlp()
    with PeakTracker({"model": model}, "cpu"):
        model(torch.randn(2, 256))
    assert len(nn_module._global_forward_pre_hooks) == before
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


def test_model_state_counts_tied_weights_once_and_reads_grads_and_state():
    embedding = torch.nn.Embedding(100, 16)  # 1,600 floats: 6,400 bytes
    head = torch.nn.Linear(16, 100, bias=False)
    head.weight = embedding.weight  # tied: one storage
    model = torch.nn.ModuleDict({"embedding": embedding, "head": head})
    optimizer = torch.optim.Adam(model.parameters())
    model["head"](model["embedding"](torch.tensor([1, 2]))).sum().backward()
    optimizer.step()
    state = model_state_bytes([model], [optimizer], "cpu")
    # Adam: two moments of 6,400 bytes and a 4-byte step counter
    assert state == {Category.PARAMETERS: 6_400, Category.GRADIENTS: 6_400, Category.OPTIMIZER_STATE: 12_804}
    assert model_state_bytes([model], [optimizer], "cuda") == dict.fromkeys(state, 0)


def test_a_compiled_model_is_counted_under_the_name_of_the_model_it_wraps():
    ns = {"model": mlp()}
    ns["compiled"] = torch.compile(ns["model"], backend="eager")  # dynamo without a code generator: CPU-safe
    with PeakTracker(ns, "cpu") as tracker:
        ns["compiled"](torch.randn(8, 256)).sum().backward()
    peak = tracker.peaks()["cpu"]
    assert by_module(peak, Category.PARAMETERS) == {"model.0": FIRST, "model.2": SECOND}
    # a batch of 8 keeps 32 KiB of activations: the peak is at the end of backward, every gradient landed
    assert by_module(peak, Category.GRADIENTS) == {"model.0": FIRST, "model.2": SECOND}


def test_a_failure_of_the_tracker_stops_it_and_never_reaches_the_cell():
    ns = {"model": mlp()}
    tracker = PeakTracker(ns, "cpu")

    def broken():
        raise ValueError("a bug of ours")

    tracker._category = broken
    with tracker:
        out = ns["model"](torch.randn(4, 256)).sum()  # the forward pass and backward run as usual
        out.backward()
    assert out.item() == out.item() and ns["model"][0].weight.grad is not None
    assert tracker.failure == "ValueError: a bug of ours"
    with pytest.raises(RuntimeError, match="the tracker stopped while the cell ran: ValueError: a bug of ours"):
        tracker.peaks()
