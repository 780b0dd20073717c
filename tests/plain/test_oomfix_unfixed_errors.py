"""Class 1 of issue 11: ``%%oomfix`` never swallows an error it did not fix.

Each failing body is run as a plain cell and under ``%%oomfix`` with several option sets; the cell
must fail the same way (``error_in_exec``, the same traceback). Out-of-memory errors that are not
fixed (``--dry-run``, a fix declined, no strategy that fits) fail the cell too."""

from __future__ import annotations

import pytest

import jupyter_cudamem.magics as magics
from jupyter_cudamem.magics.oomfix import OomFix
from tests.fakes import GiB, MiB, fake_probe
from tests.oomfix.shells import shell_without_failures
from tests.oomfix.simulated import SimulatedCell, capped_machine, fake_hardware
from tests.plain.forms import FAILURES, Observed, baseline, same_as_plain

OPTION_SETS = ("--yes", "--dry-run", "-y --max-tries 1 --strategy batch --no-autocast -o")
NOT_MEMORY = list(FAILURES)


@pytest.fixture(scope="module")
def env():
    shell = shell_without_failures()
    machine = capped_machine(6 * GiB, held_bytes=128 * MiB)
    cell = SimulatedCell(machine, lambda b: 7.05 * MiB * b + 30 * MiB)
    extension = magics.load(shell, fake_hardware(machine))
    magic = extension.get(OomFix)
    magic.probe = fake_probe()
    shell.user_ns.update(train_step=cell.train_step, MiB=MiB, GiB=GiB)
    yield shell, cell, magic
    magics.unload(shell)


def test_count():
    assert len(NOT_MEMORY) * len(OPTION_SETS) >= 100  # the closing note reports this count


@pytest.mark.parametrize("options", OPTION_SETS)
@pytest.mark.parametrize("body", NOT_MEMORY, ids=[f"{i:02d}" for i in range(len(NOT_MEMORY))])
def test_an_error_that_is_not_memory_fails_as_a_plain_cell(env, capsys, body, options):
    shell, cell, _ = env
    saved = baseline(shell)
    plain = Observed.run(shell, body, capsys, saved)
    under = Observed.run(shell, f"%%oomfix {options}\n{body}", capsys, saved)
    assert not under.success
    assert same_as_plain(plain, under) == []
    assert cell.calls == []


OOM_CELLS = (
    "batch_size = 6000\ntrain_step(batch_size)\n",
    "def go(n):\n    return train_step(n)\ngo(9000)\n",
    "for b in (100, 7000):\n    train_step(b)\n",
)


@pytest.mark.parametrize("body", OOM_CELLS)
def test_dry_run_fixes_nothing_so_the_cell_fails(env, capsys, body):
    shell, cell, magic = env
    result = shell.run_cell(f"%%oomfix --dry-run\n{body}", store_history=True)
    assert type(result.error_in_exec).__name__ == "OutOfMemoryError"
    out = capsys.readouterr()
    assert "OutOfMemoryError" in out.out and "Traceback" in out.out  # shown as a plain cell shows it
    assert "Nothing was rerun (--dry-run)" in out.out  # the lead's second line
    assert magic.last_outcome is not None and magic.last_outcome.dry_run


@pytest.mark.parametrize("body", OOM_CELLS)
def test_a_fix_that_cannot_be_asked_for_fails_the_cell(env, capsys, body):
    shell, _, _ = env
    result = shell.run_cell(f"%%oomfix\n{body}", store_history=True)  # no --yes and no stdin here
    assert result.error_in_exec is not None
    out = capsys.readouterr()
    assert "OutOfMemoryError" in out.out  # the user's error, then our one line
    assert "add --yes" in out.out + out.err


@pytest.mark.parametrize("body", OOM_CELLS)
def test_no_strategy_that_fits_fails_the_cell(env, capsys, body):
    shell, _, magic = env
    kept = shell.user_ns["train_step"]

    def train_step(n):
        raise _oom()

    shell.user_ns["train_step"] = train_step
    try:
        result = shell.run_cell(f"%%oomfix --yes --strategy cleanup\n{body}", store_history=True)
    finally:
        shell.user_ns["train_step"] = kept
    assert type(result.error_in_exec).__name__ == "OutOfMemoryError"
    assert magic.last_outcome is not None and not magic.last_outcome.fitted
    assert "OutOfMemoryError" in capsys.readouterr().out


def _oom():
    import torch

    from tests.oomfix.simulated import torch_oom_message

    return torch.OutOfMemoryError(torch_oom_message(2 * GiB, 6 * GiB, 1 * GiB, 5 * GiB, None, 5 * GiB, 0))


def test_a_fixed_cell_succeeds(env):
    shell, _, magic = env
    result = shell.run_cell("%%oomfix --yes\nbatch_size = 6000\ntrain_step(batch_size)\n", store_history=True)
    assert result.success and magic.last_outcome.fitted
