"""``ipython --ext=jupyter_cudamem script.ipy``: a script whose ``%%cudamem`` or ``%%oomfix`` cell fails exits
1, as the same script without the magic does (IPython runs a script's cells with ``silent=True``, which
sends no ``post_run_cell``; jupyter_cudamem/magics/cellrun.py ``_failed_after_all``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_script(tmp_path: Path, text: str, suffix: str = ".ipy") -> subprocess.CompletedProcess[str]:
    script = tmp_path / f"script{suffix}"
    script.write_text(text)
    env = dict(os.environ, PYTHONPATH=str(REPO), IPYTHONDIR=str(tmp_path / "ipython"))
    done = subprocess.run(
        [sys.executable, "-m", "IPython", "--ext=jupyter_cudamem", "--no-banner", str(script)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )
    plain = re.compile(r"\x1b\[[0-9;]*m")  # IPython colours its tracebacks
    return subprocess.CompletedProcess(done.args, done.returncode, plain.sub("", done.stdout), plain.sub("", done.stderr))


@pytest.mark.parametrize("magic", ["", "%%cudamem\n", "%%oomfix\n"])
def test_a_failing_cell_makes_the_script_exit_1_and_stops_it(tmp_path, magic):
    done = run_script(tmp_path, f"{magic}print('ran')\n1 / 0\n")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "ran" in done.stdout and "ZeroDivisionError" in done.stdout + done.stderr


@pytest.mark.parametrize("magic", ["", "%%cudamem\n"])
def test_a_script_that_runs_exits_0(tmp_path, magic):
    done = run_script(tmp_path, f"{magic}x = 21 * 2\nprint('answer', x)\n")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "answer 42" in done.stdout


def test_a_notebook_script_whose_magic_cell_fails_exits_1_and_runs_no_later_cell(tmp_path):
    notebook = {
        "cells": [
            {"cell_type": "code", "source": "%%cudamem\nraise ValueError('boom')\n", "metadata": {},
             "outputs": [], "execution_count": None, "id": "a"},
            {"cell_type": "code", "source": "print('later cell')\n", "metadata": {}, "outputs": [],
             "execution_count": None, "id": "b"},
        ],
        "metadata": {}, "nbformat": 4, "nbformat_minor": 5,
    }
    done = run_script(tmp_path, json.dumps(notebook), suffix=".ipynb")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "ValueError: boom" in done.stdout + done.stderr and "later cell" not in done.stdout
