"""Class 2 of issue 11: without a GPU, ``%%oomfix`` runs its body as a plain cell and says in one
line that it cannot fix out-of-memory here."""

from __future__ import annotations

import pytest

import jupyter_cudamem.magics as magics
from jupyter_cudamem.hardware import Hardware
from tests.fakes import FakeAllocator, FakeMachine, FakeNvml
from tests.oomfix.shells import shell_without_failures
from tests.plain.forms import Observed, baseline, bodies

NOTE = "cannot fix out-of-memory here"
# Every form the plain-cell test tries, thinned to keep the suite quick: each statement, last line
# and failure still appears.
BODIES = [body for body in bodies() if body][::3]


@pytest.fixture(scope="module")
def shell():
    shell = shell_without_failures()
    machine = FakeMachine()
    hardware = Hardware(
        allocator=FakeAllocator(machine, status="PyTorch sees no CUDA device"),
        nvml=FakeNvml(machine, failure="NVML: driver not loaded"),
        pid=machine.pid,
        pid_exists=lambda p: True,
    )
    magics.load(shell, hardware)
    yield shell
    magics.unload(shell)


def test_count():
    assert len(BODIES) >= 150  # the closing note reports this count


@pytest.mark.parametrize("body", BODIES, ids=[f"{i:03d}" for i in range(len(BODIES))])
def test_the_body_runs_as_a_plain_cell_after_one_line(shell, capsys, body):
    saved = baseline(shell)
    plain = Observed.run(shell, body, capsys, saved)
    under = Observed.run(shell, f"%%oomfix --yes\n{body}", capsys, saved)
    notes = [line for line in under.stderr.splitlines() if NOTE in line]
    assert len(notes) == 1 and "PyTorch sees no CUDA device" in notes[0]
    rest = "\n".join(line for line in under.stderr.splitlines() if NOTE not in line)
    assert (under.success, under.error, under.stdout, under.names, under.underscore, under.out_grew) == (
        plain.success, plain.error, plain.stdout, plain.names, plain.underscore, plain.out_grew
    )
    assert rest == plain.stderr
