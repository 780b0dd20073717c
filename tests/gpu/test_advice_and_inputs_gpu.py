"""Issue 24's advice and bad-input fixes on a real GPU, in-process (a real InteractiveShell):

- the autocast rewrite of a training loop runs the forward under autocast and backward and the
  optimizer step outside it (jupyter_cudamem/cell/edit.py);
- ``%reset -f out`` frees a tensor a ``%%cudamem`` cell showed (ipython_state.py);
- a single request larger than ``--limit`` gets no expandable_segments hint (advice.py);
- ``%oomfix`` after ``%%cudamem --limit 2GiB`` ran out of memory plans under 2 GiB (magics/oomfix.py);
- top-level ``await`` in ``%%cudamem`` is measured (magics/cellrun.py).

Run on the GPU machine: ``pytest -m gpu tests/gpu/test_advice_and_inputs_gpu.py -v``.
"""

from __future__ import annotations

import asyncio
import gc

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)"),
]

MiB, GiB = 2**20, 2**30


def test_the_autocast_rewrite_keeps_backward_and_step_outside(torch):
    from jupyter_cudamem.cell.edit import wrap_in_autocast

    source = (
        "for step in range(2):\n"
        "    optimizer.zero_grad()\n"
        "    loss = model(x).square().mean()\n"
        "    loss.backward()\n"
        "    optimizer.step()\n"
    )
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).cuda()
    optimizer = torch.optim.Adam(model.parameters())
    seen: dict[str, list[bool]] = {"forward": [], "step": [], "output": []}
    model.register_forward_hook(lambda m, i, out: seen["forward"].append(torch.is_autocast_enabled("cuda"))
                                or seen["output"].append(out.dtype in (torch.bfloat16, torch.float16)))
    optimizer.register_step_pre_hook(lambda o, a, k: seen["step"].append(torch.is_autocast_enabled("cuda")))
    wrapped = wrap_in_autocast(source, "bfloat16" if torch.cuda.is_bf16_supported() else "float16")
    exec(wrapped, {"torch": torch, "model": model, "optimizer": optimizer, "x": torch.randn(32, 64, device="cuda")})
    assert seen == {"forward": [True, True], "step": [False, False], "output": [True, True]}
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())


def test_reset_out_frees_the_tensor_a_cudamem_cell_showed(shell, torch):
    gc.collect()
    start = torch.cuda.memory_allocated()
    shell.run_cell("%%cudamem\ntorch.ones(32 * 2**20, device='cuda')", store_history=True)  # 128 MiB shown
    assert torch.cuda.memory_allocated() - start == 128 * MiB
    shell.run_cell("%reset -f out", store_history=True)
    shell.run_cell("1 + 1", store_history=True)
    gc.collect()
    assert torch.cuda.memory_allocated() - start == 0


def test_a_request_larger_than_the_limit_gets_no_expandable_segments_hint(shell, torch, capsys):
    result = shell.run_cell("%%cudamem -v --limit 2GiB\nbig = torch.empty(4 * 2**30, dtype=torch.uint8, device='cuda')")
    assert isinstance(result.error_in_exec, torch.OutOfMemoryError)
    hints = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("hint:")]
    assert any("run %oomfix" in hint for hint in hints), hints
    assert not any("expandable_segments" in hint for hint in hints), hints  # 4 GiB asked under a 2 GiB cap


def test_oomfix_after_a_limited_cell_plans_under_the_limit(shell, torch):
    shell.user_ns["layer"] = torch.nn.Linear(1024, 1024).cuda()
    # About 12 KiB a sample (the input, the output autograd keeps, the ReLU's): 12 GiB at 2**20.
    cell = "%%cudamem --limit 2GiB\nbatch_size = 1048576\nout = layer(torch.randn(batch_size, 1024, device='cuda')).relu()\n"
    failed = shell.run_cell(cell, store_history=True)
    assert isinstance(failed.error_in_exec, torch.OutOfMemoryError)
    outcome = shell.run_line_magic("oomfix", "--yes --max-tries 3 -o")
    assert outcome.budget_bytes <= 2 * GiB
    assert outcome.fitted and outcome.batch_after < 1048576
    assert any(note.startswith("planned under the cell's --limit 2.00 GiB") for note in outcome.notes)
    for name in ("layer", "out"):
        shell.user_ns.pop(name, None)


def test_an_awaiting_cudamem_body_runs_and_is_measured_inside_a_running_loop(shell, torch):
    async def inside():
        return shell.run_cell(
            "%%cudamem -o\nimport asyncio\nawait asyncio.sleep(0.01)\nkept = torch.empty(64 * 2**20, dtype=torch.uint8, "
            "device='cuda')", store_history=True)

    result = asyncio.run(inside())
    assert result.success, result.error_in_exec
    report = result.result
    assert report.measurement.devices[0].allocated_delta_bytes == 64 * MiB
    shell.user_ns.pop("kept", None)


@pytest.mark.parametrize("graph", [True, False])
def test_oomfix_offers_no_grad_and_checkpointing_only_where_the_failed_run_kept_a_graph(shell, torch, graph):
    # A cell that trains nothing runs out in a model's call. With autograd on, the failure comes in the
    # fourth block, each earlier block's output kept for a backward pass (512 MiB each): no_grad and
    # checkpointing would save them. Through a function that runs under no_grad itself (as
    # transformers' generate() does), nothing is kept: the failure is the first block's own output
    # (2 GiB beside a 2 GiB input), and neither would save a byte.
    shell.run_cell(
        "import torch\nfrom torch import nn\n"
        "mlp = nn.Sequential(*[nn.Sequential(nn.Linear(4096, 4096), nn.GELU()) for _ in range(6)]).cuda()\n"
        "@torch.no_grad()\ndef generate(x):\n    return mlp(x)\n"
    )
    cell = ("%%cudamem --limit 4GiB\nout = mlp(torch.randn(32768, 4096, device='cuda'))\n" if graph else
            "%%cudamem --limit 4GiB\nout = generate(torch.randn(131072, 4096, device='cuda'))\n")
    failed = shell.run_cell(cell, store_history=True)
    try:
        assert isinstance(failed.error_in_exec, torch.OutOfMemoryError)
        outcome = shell.run_line_magic("oomfix", "--dry-run -o")
        suggestions = outcome.diagnosis.suggestions
    finally:
        from jupyter_cudamem.hardware import default_hardware
        from jupyter_cudamem.oomfix.cleanup import cleanup

        del failed
        cleanup(shell, default_hardware())  # the failed run's traceback let go of, for the next case
        for name in ("mlp", "generate", "out"):  # the shell is the session's: later tests count its models
            shell.user_ns.pop(name, None)
        torch.cuda.empty_cache()
    assert any(s.startswith("half the batch") for s in suggestions), suggestions
    assert any("no_grad" in s for s in suggestions) is graph, suggestions
    assert any("checkpointing" in s for s in suggestions) is graph, suggestions
