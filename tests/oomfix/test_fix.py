"""``%oomfix``'s feature entry (jupyter_cudamem/oomfix/fix.py, request.py): a failed cell read into a
``FixRequest`` is fixed with only the shell, the hardware and the tries it is handed; no magic is loaded.
A real InteractiveShell, a simulated cell whose OOM carries a real torch message, fake hardware."""

from __future__ import annotations

import pytest

from jupyter_cudamem.ipython_state import FailureRecorder
from jupyter_cudamem.oom import OomKind, OomInfo, oom_device, parse_oom
from jupyter_cudamem.oomfix.diagnosis import Diagnosis
from jupyter_cudamem.oomfix.fix import fix
from jupyter_cudamem.oomfix.request import FixRequest
from jupyter_cudamem.oomfix.strategies import STRATEGIES
from tests.fakes import GiB, MiB
from tests.oomfix.shells import shell_without_failures
from tests.oomfix.simulated import SimulatedCell, capped_machine, fake_hardware

CNN = lambda b: 7.05 * MiB * b + 30 * MiB  # noqa: E731

FAILING_CELL = """batch_size = 6000
train_step(batch_size)
finished_with = batch_size
"""


class ShellTries:
    """Each try as IPython input, its OOM parsed from its exception (the magic's own hides their tracebacks)."""

    def __init__(self, shell):
        self.shell = shell

    def run_source(self, source):
        result = self.shell.run_cell(source, store_history=False)
        return result.error_in_exec

    def oom_of(self, error):
        return parse_oom(error)

    def forget(self):
        pass


@pytest.fixture
def failed(capsys):
    shell = shell_without_failures()
    assert "oomfix" not in shell.magics_manager.magics["line"]  # the feature runs without the magic
    machine = capped_machine(6 * GiB, held_bytes=128 * MiB)
    cell = SimulatedCell(machine, CNN)
    shell.user_ns.update(train_step=cell.train_step)
    recorder = FailureRecorder()
    recorder.attach(shell)
    error = shell.run_cell(FAILING_CELL, store_history=True).error_in_exec
    assert type(error).__name__ == "OutOfMemoryError"
    capsys.readouterr()
    yield shell, machine, cell, recorder, error
    recorder.detach(shell)
    for name in ("train_step", "batch_size", "finished_with"):
        shell.user_ns.pop(name, None)


def _request(error, **options):
    return FixRequest(FAILING_CELL, parse_oom(error), max_tries=3, strategies=STRATEGIES, margin=0.04, **options)


def test_the_feature_fixes_a_failed_cell_from_its_request(failed):
    shell, machine, cell, recorder, error = failed
    outcome = fix(_request(error, ask=False, cell_number=7), error, shell=shell, hardware=fake_hardware(machine),
                  reruns=ShellTries(shell), recorder=recorder)
    del error
    true_max = cell.largest_fitting(6000)
    assert outcome is not None and outcome.fitted and outcome.strategy == "batch"
    assert 0.9 * true_max <= outcome.batch_after <= true_max and outcome.batch_before == 6000
    assert shell.user_ns["finished_with"] == outcome.batch_after  # the namespace holds the run that fitted
    assert outcome.cell_name == "In[7]" and outcome.kept and outcome.diagnosis is not None
    assert cell.calls[1:] == [t.batch for t in outcome.tries]  # the failed run, then exactly the tries


def test_a_declined_question_reruns_nothing_and_is_asked_with_the_diagnosis(failed):
    shell, machine, cell, recorder, error = failed
    asked = []

    def decline(diagnosis, trained, restore, too_large):
        asked.append(diagnosis)
        return False

    outcome = fix(_request(error), error, shell=shell, hardware=fake_hardware(machine), reruns=ShellTries(shell),
                  recorder=recorder, confirm=decline)
    assert outcome is None
    assert len(asked) == 1 and isinstance(asked[0], Diagnosis)
    assert cell.calls == [6000]  # only the failed run: nothing was rerun
    assert "finished_with" not in shell.user_ns


def test_an_unknown_name_to_delete_is_one_line_and_changes_nothing(failed):
    from jupyter_cudamem.errors import CudaMemError

    shell, machine, cell, recorder, error = failed
    with pytest.raises(CudaMemError, match=r"^--del no_such_name: no such variable; nothing was deleted$"):
        fix(_request(error, ask=False, delete=("train_step", "no_such_name")), error, shell=shell,
            hardware=fake_hardware(machine), reruns=ShellTries(shell), recorder=recorder)
    assert "train_step" in shell.user_ns and cell.calls == [6000]
    assert error.__traceback__ is not None  # nothing released either


def test_the_device_is_the_one_the_oom_names_else_0():
    assert oom_device(OomInfo(OomKind.ALLOCATOR, "", device_index=3)) == 3
    assert oom_device(OomInfo(OomKind.DRIVER, "CUDA error: out of memory")) == 0
    assert oom_device(None) == 0
    request = FixRequest("x = 1\n", OomInfo(OomKind.ALLOCATOR, "", device_index=2), max_tries=1,
                         strategies=STRATEGIES, margin=0.04)
    assert request.cell_name == "the cell"


def test_what_the_failed_cell_binds_is_its_own_memory_not_your_variables(failed, monkeypatch):
    # Tutorial 00's cell binds ``inputs`` and fails a line later: the diagnosis said "your variables hold
    # 1.25 GiB", naming ``inputs``, which any rerun makes again. The cell's own names are searched (their
    # name holds them) but passed as remade; an earlier cell's are the user's variables.
    shell, machine, cell, recorder, error = failed
    shell.user_ns["earlier"] = object()
    seen, remade = {}, set()

    def holders_of(variables, references, probe=None, remade=()):
        seen.update(variables)
        remade_names.update(remade)
        return []

    remade_names = remade

    monkeypatch.setattr("jupyter_cudamem.oomfix.fix.find_holders", holders_of)
    outcome = fix(_request(error, ask=False, dry_run=True), error, shell=shell, hardware=fake_hardware(machine),
                  reruns=ShellTries(shell), recorder=recorder)
    del error
    assert outcome is not None
    assert "batch_size" in remade and "earlier" not in remade and "train_step" not in remade
    assert {"batch_size", "earlier", "train_step"} <= seen.keys()
    shell.user_ns.pop("earlier")
