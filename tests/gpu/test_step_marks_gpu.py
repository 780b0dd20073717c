"""The optimizer's steps marked in a rerun's recorded history on the real CUDA caching allocator
(``sources.torch_alloc.StepMarks``, ``sources.torch_trace.without_step_marks``): a three-step AdamW loop's
steps are found, what they made is its state and foreach temporaries (each a parameter's size), and the
one-run replay of a small batch, taking those as fixed, puts the largest batch near where it is."""

from __future__ import annotations

import pytest

from jupyter_cudamem.growth.line import made_in_steps
from jupyter_cudamem.reruns.recording import Recorder
from jupyter_cudamem.sources.base import STEP_MARK_BYTES

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def loop(torch, model, optimizer, batch: int, steps: int = 3) -> None:
    for _ in range(steps):
        inputs = torch.randn(batch, 2048, device="cuda")
        loss = model(inputs).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_a_loops_steps_are_marked_and_what_they_made_is_the_parameters_size(torch):
    from jupyter_cudamem.sources.torch_alloc import TorchAllocator

    model = torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 2048)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    sizes = {p.numel() * p.element_size() for p in model.parameters()}
    source = TorchAllocator()
    recorder = Recorder(source, windows=True)
    start = recorder.start(0)
    assert start is not None
    loop(torch, model, optimizer, batch=4)
    torch.cuda.synchronize()
    run = recorder.stop(start, 0, failed=False)
    assert run is not None and len(run.steps) == 3, run and run.steps
    made = [size for kind, key, size, _ in run.events if kind == "alloc" and key in made_in_steps(run.events, run.steps)]
    assert made and all(size in sizes or size <= 512 for size in made), sorted(set(made))
    assert sum(made) >= 2 * sum(sizes)  # the first step's two moments of each parameter, at least
    assert all(size not in STEP_MARK_BYTES for _, _, size, _ in run.events)  # the marks left the run
    del optimizer, model
    torch.cuda.empty_cache()
