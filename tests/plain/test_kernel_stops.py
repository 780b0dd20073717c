"""Classes 1 and 3 of issue 11 in a real kernel through nbclient: a notebook run with errors not
allowed stops at a failing ``%%oomfix`` or ``%%cudamem`` cell, as it stops at a failing plain cell."""

from __future__ import annotations

import os

import pytest

from tests.notebook_runner import REPO

pytestmark = pytest.mark.notebook

SETUP = """from jupyter_cudamem import magics
from jupyter_cudamem.hardware import Hardware
from tests.fakes import FakeAllocator, FakeMachine, FakeNvml
machine = FakeMachine()
magics.load(get_ipython(), Hardware(allocator=FakeAllocator(machine), nvml=FakeNvml(machine), pid=machine.pid, pid_exists=lambda p: True))
"""

CASES = (
    ("", "1/0", "ZeroDivisionError"),  # the plain cell, for comparison
    ("%%oomfix --yes\n", "1/0", "ZeroDivisionError"),
    ("%%oomfix --yes\n", "x = (", "SyntaxError"),
    ("%%oomfix --dry-run\n", "import sys\nsys.exit(2)", "SystemExit"),
    ("%%cudamem\n", "def f(:\n    pass", "SyntaxError"),
    ("%%cudamem\n", "raise KeyboardInterrupt", "KeyboardInterrupt"),
)


@pytest.mark.parametrize("magic, body, error", CASES, ids=[f"{m.strip() or 'plain'}-{e}" for m, _, e in CASES])
def test_a_run_that_stops_on_errors_stops_at_the_failing_cell(magic, body, error):
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    notebook = nbformat.v4.new_notebook()
    for source in (SETUP, "before = 1", magic + body, "after = 1"):
        notebook.cells.append(nbformat.v4.new_code_cell(source))
    client = NotebookClient(notebook, kernel_name="python3", timeout=120, resources={"metadata": {"path": str(REPO)}})
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    with pytest.raises(CellExecutionError) as failure:
        client.execute(env={**os.environ, "PYTHONPATH": path})
    assert error in str(failure.value)
    failing, after = notebook.cells[2], notebook.cells[3]
    assert after.execution_count is None and not after.outputs  # the run stopped there
    [shown] = [output for output in failing.outputs if output.output_type == "error"]
    assert shown.ename == error
    assert "jupyter_cudamem" not in "".join(shown.traceback)  # the user's traceback, none of ours
