"""Issue 41: the extension's start-of-cell reading imported torch in the first cell after ``%load_ext`` (seconds on a
CPU machine), where a Ctrl-C left torch half imported and the kernel unable to import it again, with a traceback
of ours ("Error in callback ... _note_cell_start"). Nothing is read before the user's torch starts CUDA; and a torch
that fails to import is one line of what cannot be measured."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from jupyter_cudamem.sources.torch_alloc import TorchAllocator

CELLS = """
from IPython.testing.globalipapp import start_ipython
import sys
shell = start_ipython()
shell.run_cell("%load_ext jupyter_cudamem")
shell.run_cell("x = 1")
shell.run_cell("y = x + 1")
print("torch imported:", "torch" in sys.modules)
"""


def test_a_plain_cell_after_load_ext_imports_no_torch(tmp_path):
    run = subprocess.run([sys.executable, "-c", CELLS], capture_output=True, text=True, timeout=120,
                         env={"IPYTHONDIR": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).parents[2])},
                         cwd=str(tmp_path))
    assert "torch imported: False" in run.stdout, run.stdout + run.stderr


def test_a_torch_that_fails_to_import_is_a_reason_not_a_traceback(monkeypatch):
    import jupyter_cudamem.sources.torch_alloc as torch_alloc

    def broken():
        raise RuntimeError("Only a single TORCH_LIBRARY can be used to register the namespace prims\nmore")

    monkeypatch.setattr(torch_alloc, "_torch", broken)
    status = TorchAllocator().status()
    assert status is not None and "fails to import (RuntimeError: Only a single TORCH_LIBRARY" in status
    assert "restart the kernel" in status and "\n" not in status
