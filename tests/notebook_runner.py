"""Run code cells in a real kernel through nbclient and read what they showed (tests only)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def gpu_notebook_module() -> tuple[Any, list[Any]]:
    """For a test module that runs notebooks on a GPU: torch (the module is skipped where torch or nbclient
    is missing) and the module's marks, ``gpu`` and ``notebook``, skipped where no CUDA device is visible."""
    import pytest

    torch = pytest.importorskip("torch")
    pytest.importorskip("nbclient")
    return torch, [
        pytest.mark.gpu,
        pytest.mark.notebook,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)"),
    ]


def run_cells(cells: list[str], timeout: int = 180, allow_errors_in: set[int] | None = None, save_to: Path | None = None):
    """Execute ``cells`` in order in a fresh ``python3`` kernel; return the executed notebook.

    Cells listed in ``allow_errors_in`` are tagged ``raises-exception`` (they are expected to fail).
    """
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.v4.new_notebook()
    for index, source in enumerate(cells):
        cell = nbformat.v4.new_code_cell(source)
        if allow_errors_in and index in allow_errors_in:
            cell.metadata["tags"] = ["raises-exception"]
        notebook.cells.append(cell)
    client = NotebookClient(notebook, kernel_name="python3", timeout=timeout, resources={"metadata": {"path": str(REPO)}})
    # The kernel imports this checkout's jupyter_cudamem and tests/fakes, whatever is installed.
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    client.execute(env={**os.environ, "PYTHONPATH": path})
    if save_to is not None:
        nbformat.write(notebook, save_to)
    return notebook


def run_cell_outputs(cells: list[str], timeout: int = 120) -> list[list[dict]]:
    """``run_cells`` for tests that only read outputs: each cell's outputs, in order."""
    return [cell.outputs for cell in run_cells(cells, timeout=timeout).cells]


def stdout_json(outputs: list[dict]) -> object:
    """The JSON a cell printed as its last line of standard output."""
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream" and o.get("name") == "stdout")
    return json.loads(text.strip().splitlines()[-1])


def text_of(cell) -> str:
    """Everything a cell showed as text: streams, text/plain results, error tracebacks."""
    parts = []
    for output in cell.get("outputs", []):
        if output.output_type == "stream":
            parts.append(output.text)
        elif output.output_type in ("execute_result", "display_data"):
            parts.append(output.data.get("text/plain", ""))
        elif output.output_type == "error":
            parts.append(f"{output.ename}: {output.evalue}")
    return "\n".join(parts)


def html_of(cell) -> str:
    return "\n".join(
        output.data.get("text/html", "")
        for output in cell.get("outputs", [])
        if output.output_type in ("execute_result", "display_data")
    )


def json_line(cell, marker: str = "RESULT "):
    """The JSON a cell printed after ``marker`` (cells report measured values this way)."""
    for line in text_of(cell).splitlines():
        if line.startswith(marker):
            return json.loads(line[len(marker) :])
    raise AssertionError(f"no {marker!r} line in cell output:\n{text_of(cell)}")


# -- whole tutorial notebooks (scripts/run_notebook.py and tests/gpu/test_notebooks_gpu.py) ------------------

EXPECTED_ERROR_TAG = "raises-exception"
_SITE_PACKAGES = re.compile(r"(?:[A-Za-z]:)?[^\s'\"]*[/\\](?:site|dist)-packages[/\\]")


def tags(cell) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


# ipyparallel streams an engine's traceback as stderr, headed "[1:execute]" (engine 1, an execute request).
_REMOTE_ERROR = re.compile(r"\[\d+:\w+\]\n")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _remote_error_line(text: str) -> str:
    """An engine's streamed traceback of an expected error, cut as a local one is: its header and error line."""
    lines = [_ANSI.sub("", line) for line in text.splitlines() if line.strip()]
    return f"{lines[0]}\n{lines[-1]}\n"


def tidy_outputs(notebook) -> None:
    """Keep what a reader needs and nothing of the machine that ran it.

    An expected error (a cell tagged ``raises-exception``) keeps only its last line, ``Name: message``:
    the frames of its traceback name files on that machine. A warning on stderr names the library file that
    raised it by its path under ``site-packages``; the path is cut to the package (``torch/nn/...``). An
    unexpected error keeps its whole traceback: it is what someone has to debug. An engine's traceback that
    ipyparallel streams under ``%%px`` is cut the same way in a cell tagged ``raises-exception``.
    """
    for cell in notebook.cells:
        if cell.cell_type != "code":
            continue
        for output in cell.get("outputs", []):
            if output.output_type == "error" and EXPECTED_ERROR_TAG in tags(cell):
                output.traceback = [f"{output.ename}: {output.evalue}"]
            elif output.output_type == "stream" and output.get("name") == "stderr":
                if EXPECTED_ERROR_TAG in tags(cell) and _REMOTE_ERROR.match(output.text):
                    output.text = _remote_error_line(output.text)
                else:
                    output.text = _SITE_PACKAGES.sub("", output.text)


def execute_notebook(path: Path, timeout: int = 300, kernel: str = "python3", without_tag: str | None = None):
    """Run the notebook at ``path`` top to bottom in a fresh kernel, in its own folder, with this checkout first
    on ``PYTHONPATH``. Returns ``(notebook, error, seconds)``: ``error`` is the ``CellExecutionError`` of a cell
    that failed without the ``raises-exception`` tag (nbclient stops there), else ``None``. Cells tagged
    ``skip-execution`` are not run; cells tagged ``without_tag`` (``"gpu"`` on a machine without one) are left out
    of the returned notebook altogether. Outputs are tidied (``tidy_outputs``) either way.
    """
    import time

    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    notebook = nbformat.read(path, as_version=4)
    if without_tag is not None:
        notebook.cells = [cell for cell in notebook.cells if without_tag not in tags(cell)]
    client = NotebookClient(
        notebook, kernel_name=kernel, timeout=timeout, resources={"metadata": {"path": str(Path(path).parent)}}
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    started = time.monotonic()
    error = None
    try:
        client.execute(env=env)
    except CellExecutionError as failure:
        error = failure
    seconds = time.monotonic() - started
    tidy_outputs(notebook)
    return notebook, error, seconds
