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
    run = subprocess.run([sys.executable, "-c", CELLS], capture_output=True, text=True, timeout=120, check=False,
                         env={"IPYTHONDIR": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).parents[2])},
                         cwd=str(tmp_path))
    assert "torch imported: False" in run.stdout, run.stdout + run.stderr


def test_a_torch_that_fails_to_import_is_a_reason_not_a_traceback(monkeypatch):
    from jupyter_cudamem.sources import torch_alloc

    def broken():
        raise RuntimeError("Only a single TORCH_LIBRARY can be used to register the namespace prims\nmore")

    monkeypatch.setattr(torch_alloc, "_torch", broken)
    status = TorchAllocator().status()
    assert status is not None and "fails to import (RuntimeError: Only a single TORCH_LIBRARY" in status
    assert "restart the kernel" in status and "\n" not in status


INTERRUPTED_IMPORT = """
import os, signal, sys, threading, time

def interrupt_mid_import():
    while "torch._decomp" not in sys.modules:  # well into torch's import (an interrupt there broke torch)
        time.sleep(0.0002)
    os.kill(os.getpid(), signal.SIGINT)  # a kernel's interrupt, while torch is half imported

threading.Thread(target=interrupt_mid_import, daemon=True).start()
from jupyter_cudamem.sources.torch_alloc import TorchAllocator
try:
    TorchAllocator().status()
    time.sleep(2)
    print("not interrupted")
except KeyboardInterrupt:
    print("interrupted")
import torch
print("torch works:", int((torch.zeros(2) + 1).sum()))
"""


def test_a_ctrl_c_while_our_magic_imports_torch_leaves_torch_whole(tmp_path):
    """The first magic of ours imports torch (seconds): the interrupt is raised once the import is done."""
    run = subprocess.run([sys.executable, "-c", INTERRUPTED_IMPORT], capture_output=True, text=True, timeout=120, check=False,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).parents[2]),
                              "OMP_NUM_THREADS": "1"}, cwd=str(tmp_path))
    assert "interrupted" in run.stdout and "torch works: 2" in run.stdout, run.stdout + run.stderr[-2000:]
