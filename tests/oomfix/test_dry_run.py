"""``%oomfix --dry-run``: the diagnosis the message allows and the plan, without a GPU
(jupyter_cudamem/magics/oomfix.py)."""

from __future__ import annotations

import pytest
import torch

from jupyter_cudamem import magics
from jupyter_cudamem.magics.oomfix import OomFix
from jupyter_cudamem.hardware import Hardware
from tests.fakes import FakeAllocator, FakeNvml, GiB, MiB
from tests.oomfix.shells import shell_without_failures
from tests.oomfix.simulated import capped_machine, fake_hardware, torch_oom_message

MESSAGE = torch_oom_message(2 * GiB, 80 * GiB, 1 * GiB, 79 * GiB, None, 70 * GiB, 100 * MiB)


def no_gpu() -> Hardware:
    machine = capped_machine(6 * GiB)
    return Hardware(
        allocator=FakeAllocator(machine, status="PyTorch sees no CUDA device"),
        nvml=FakeNvml(machine, failure="NVML: driver not loaded"),
        pid=machine.pid,
        pid_exists=lambda p: True,
    )


@pytest.fixture(params=["no GPU", "fake GPU"])
def shell(request):
    shell = shell_without_failures()
    hardware = no_gpu() if request.param == "no GPU" else fake_hardware(capped_machine(6 * GiB, held_bytes=128 * MiB))
    magics.load(shell, hardware)
    shell.user_ns.update(torch=torch, MESSAGE=MESSAGE)
    shell.run_cell("config = {'lr': 1e-3,\n          'batch_size': 256}\n", store_history=True)
    shell.run_cell("def train_step(x):\n    raise torch.OutOfMemoryError(MESSAGE)\n", store_history=True)
    yield shell, request.param
    magics.unload(shell)


def test_line_magic_shows_the_plan_and_changes_nothing(shell, capsys):
    shell, kind = shell
    failing = "for epoch in range(3):\n    x = torch.randn(config['batch_size'], 10)\n    train_step(x)\n"
    assert shell.run_cell(failing, store_history=True).error_in_exec is not None
    capsys.readouterr()
    outcome = shell.run_line_magic("oomfix", "--dry-run --verbose -o")
    assert outcome.dry_run and outcome.tries == () and outcome.diagnosis is not None
    assert outcome.plan.knob.label == 'config["batch_size"]' and outcome.plan.first_batch is not None
    out = capsys.readouterr().out
    assert "diagnosis only" in out and "CUDA out of memory" in out
    assert 'smaller batch: config["batch_size"] = 256 (a config field, In[' in out and "first try:" in out
    assert f"+          'batch_size': {outcome.plan.first_batch}}}" in out
    assert ("the error message's free memory" in out) == (kind == "no GPU")
    assert shell.user_ns["config"]["batch_size"] == 256


def test_cell_magic_dry_run_too_and_the_cell_still_fails(shell, capsys):
    shell, _ = shell
    result = shell.run_cell(
        "%%oomfix --dry-run -o\nx = torch.randn(config['batch_size'], 10)\ntrain_step(x)\n", store_history=True
    )
    assert type(result.error_in_exec).__name__ == "OutOfMemoryError"  # --dry-run fixes nothing
    outcome = magics.loaded(shell).get(OomFix).last_outcome
    assert outcome.dry_run and outcome.plan.knob.value == 256
    assert shell.user_ns["config"]["batch_size"] == 256


def test_without_dry_run_a_machine_without_gpu_still_says_what_it_needs():
    shell = shell_without_failures()
    magics.load(shell, no_gpu())
    try:
        result = shell.run_cell("%oomfix --yes", store_history=True)
        assert str(result.error_in_exec) == "%oomfix needs a CUDA device: PyTorch sees no CUDA device"
        result = shell.run_cell("%oomfix --dry-run", store_history=True)
        assert "no failed cell to fix" in str(result.error_in_exec)
    finally:
        magics.unload(shell)
