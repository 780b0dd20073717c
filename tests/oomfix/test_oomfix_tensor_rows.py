"""``%oomfix`` on a cell whose batch is the rows of a tensor an earlier cell made: the tries cut the
tensor where it lives, the fitted batch is shown as a diff of that earlier cell, and the cell's own text
stays as it was. Real shell, fake hardware, a simulated step (``tests/oomfix/simulated.py``)."""

from __future__ import annotations

import pytest

import jupyter_cudamem.magics as magics
from jupyter_cudamem.magics.oomfix import OomFix
from tests.fakes import GiB, MiB, fake_probe
from tests.oomfix.shells import shell_without_failures
from tests.oomfix.simulated import SimulatedCell, capped_machine, fake_hardware

torch = pytest.importorskip("torch")

CNN = lambda b: 7.05 * MiB * b + 30 * MiB  # noqa: E731  (as in test_oomfix_magic)

MODEL = '''
class Loss:
    def backward(self):
        pass

class Net:
    """A model as the finder sees one (forward, modules) whose step's memory is the simulated cell's."""
    def modules(self):
        return iter(())
    def forward(self, x):
        train_step(x.shape[0])
        return Loss()
    __call__ = forward

model = Net()
'''


@pytest.fixture
def env():
    shell = shell_without_failures()
    shell.rl_next_input = None
    shell.history_manager.reset(new_session=True)
    shell.execution_count = 1
    machine = capped_machine(6 * GiB, held_bytes=128 * MiB)
    cell = SimulatedCell(machine, CNN)
    extension = magics.load(shell, fake_hardware(machine))
    extension.get(OomFix).probe = fake_probe()
    shell.user_ns.update(train_step=cell.train_step, torch=torch)
    yield shell, cell
    magics.unload(shell)


def test_the_rows_of_an_earlier_cells_tensor_are_cut_and_the_earlier_cell_is_the_diff(env, capsys):
    shell, cell = env
    assert shell.run_cell(MODEL, store_history=True).success
    assert shell.run_cell("inputs = torch.zeros(6000, 2)\n", store_history=True).success
    failing = "loss = model(inputs)\nloss.backward()\nfinished_with = inputs.shape[0]\n"
    failed = shell.run_cell(failing, store_history=True)
    assert type(failed.error_in_exec).__name__ == "OutOfMemoryError"
    outcome = shell.run_line_magic("oomfix", "--yes -o --max-tries 3")  # other tests %config a smaller one
    true_max = cell.largest_fitting(6000)
    assert outcome.fitted and outcome.strategy == "batch"
    assert 0.9 * true_max <= outcome.batch_after <= true_max
    assert shell.user_ns["finished_with"] == outcome.batch_after  # the rerun fed that many rows
    assert shell.user_ns["inputs"].shape == (outcome.batch_after, 2)  # the tensor holds the fitted rows
    out = capsys.readouterr().out
    assert f"inputs = torch.zeros({outcome.batch_after}, 2)" in out  # the diff of In[2]
