"""``%oomfix``'s reruns leave no trace on a real GPU (jupyter_cudamem/reruns/model_state.py): PyTorch capped
at 2 GiB with ``set_per_process_memory_fraction``, a training cell of three Adam steps runs out of memory
at batch 131072, and after ``%oomfix`` the model's weights, ``.grad`` and Adam's state, and the list and dict
the cell logs to, equal those of one plain run of the fitted cell on a copy made before the failure.

Run on the GPU machine: ``pytest -m gpu tests/gpu/test_oomfix_restore_gpu.py -v``.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)"),
]

# 256 inputs, 2048 hidden: about 40 KiB per sample in forward and backward, 5 GiB at 131072.
CELL = """batch_size = 131072
x = torch.linspace(-1, 1, batch_size * 256, device="cuda").view(batch_size, 256)
for _ in range(3):
    optimizer.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
    seen["steps"] += 1
"""


def test_weights_grads_and_adam_state_are_those_of_one_run_of_the_fitted_cell(shell, torch):
    fraction = 2 * 2**30 / torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(fraction)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1)).cuda()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        reference_model, reference_optimizer = copy.deepcopy((model, optimizer))
        losses: list[float] = []
        seen = {"steps": 0}
        shell.user_ns.update(model=model, optimizer=optimizer, losses=losses, seen=seen)
        failed = shell.run_cell(CELL, store_history=True)
        assert isinstance(failed.error_in_exec, torch.OutOfMemoryError)
        outcome = shell.run_line_magic("oomfix", "--yes -o")
        assert outcome.fitted and outcome.strategy == "batch"
        assert sum(1 for t in outcome.tries if t.fitted) >= 2 or len(outcome.tries) >= 2, outcome.tries
        assert any("put back before each rerun" in note for note in outcome.notes), outcome.notes
        for name in ("x", "loss"):  # the fitted run's input and graph: the plain run makes its own
            shell.user_ns.pop(name, None)
        plain = {"torch": torch, "model": reference_model, "optimizer": reference_optimizer, "losses": [],
                 "seen": {"steps": 0}}
        # The reference run is the test's, not the user's: uncapped, so what earlier tests left cached (the
        # two-GPU tests, on a machine with two) cannot make it run out of memory where %oomfix's runs fitted.
        torch.cuda.set_per_process_memory_fraction(1.0)
        exec(outcome.fixed_source, plain)
        # The list and the dict the cell logs to: one run's entries, in the same objects.
        assert shell.user_ns["losses"] is losses and losses == plain["losses"] and len(losses) == 3
        assert shell.user_ns["seen"] is seen and seen == {"steps": 3}
        for mine, theirs in zip(model.parameters(), reference_model.parameters()):
            assert torch.equal(mine, theirs) and torch.equal(mine.grad, theirs.grad)
        state, reference = optimizer.state_dict()["state"], reference_optimizer.state_dict()["state"]
        assert state.keys() == reference.keys()
        for key in state:
            assert state[key]["step"].item() == 3.0  # one run: three steps, whatever the reruns took
            assert torch.equal(state[key]["exp_avg"], reference[key]["exp_avg"])
            assert torch.equal(state[key]["exp_avg_sq"], reference[key]["exp_avg_sq"])
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        shell.user_ns.pop("model", None)
        shell.user_ns.pop("optimizer", None)
        shell.user_ns.pop("losses", None)
        shell.user_ns.pop("seen", None)
