"""Top-level ``await`` in a magic's body where an event loop is running the cell, as in a kernel
(ipykernel runs each cell inside its asyncio loop): the body runs, as a plain cell's would
(jupyter_cudamem/magics/cellrun.py ``_await_beside``). Emulated by running the cell from a coroutine."""

from __future__ import annotations

import asyncio
import re

import pytest


def run_in_a_loop(shell, cell: str):
    async def inside():
        return shell.run_cell(cell, store_history=True)

    return asyncio.run(inside())


@pytest.mark.parametrize(
    "cell",
    [
        "%%cudamem\nimport asyncio\nawaited = await asyncio.sleep(0, result=7)",
        "%cudamem awaited = await __import__('asyncio').sleep(0, result=7)",
        "%%oomfix\nimport asyncio\nawaited = await asyncio.sleep(0, result=7)",
    ],
)
def test_await_in_the_body_runs(shell, cell, capsys):
    shell.user_ns.pop("awaited", None)
    result = run_in_a_loop(shell, cell)
    assert result.success, result.error_in_exec
    assert shell.user_ns["awaited"] == 7
    assert "top-level await cannot run" not in capsys.readouterr().err


def test_await_in_a_plan_body_runs_before_the_plan_says_what_it_measured(shell, capsys):
    shell.user_ns.pop("awaited", None)
    run_in_a_loop(shell, "%%cudamem_plan\nimport asyncio\nawaited = await asyncio.sleep(0, result=7)")
    assert shell.user_ns["awaited"] == 7  # ran; the plan itself has nothing to measure on fake hardware


def test_an_awaited_value_is_displayed_and_its_error_is_the_plain_cells(shell, capsys):
    result = run_in_a_loop(shell, "%%cudamem\nimport asyncio\nawait asyncio.sleep(0, result='shown')")
    assert result.success and "shown" in capsys.readouterr().out
    result = run_in_a_loop(shell, "%%cudamem\nimport asyncio\nawait asyncio.sleep(0)\n1 / 0")
    assert isinstance(result.error_in_exec, ZeroDivisionError)
    out = capsys.readouterr()
    text = re.sub(r"\x1b\[[0-9;]*m", "", out.out + out.err)
    assert "ZeroDivisionError" in text and "cellrun" not in text and "_await_beside" not in text


def test_what_is_bound_to_the_kernels_loop_says_so_in_asyncios_words(shell, capsys):
    async def cells():
        shell.run_cell("import asyncio\nmade_here = asyncio.get_running_loop().create_future()", store_history=True)
        return shell.run_cell("%%cudamem\nawait made_here", store_history=True)

    result = asyncio.run(cells())
    assert isinstance(result.error_in_exec, (RuntimeError, ValueError))
    assert "loop" in str(result.error_in_exec)


@pytest.mark.notebook
def test_in_a_real_kernel_every_magic_runs_an_awaiting_body():
    pytest.importorskip("nbclient")
    from tests.notebook_runner import run_cells

    notebook = run_cells([
        "%load_ext jupyter_cudamem\nimport asyncio",
        "%%cudamem\nfirst = await asyncio.sleep(0.01, result=1)",
        "%cudamem second = await asyncio.sleep(0.01, result=2)",
        "%%oomfix\nthird = await asyncio.sleep(0.01, result=3)",
        "%%cudamem_plan\nfourth = await asyncio.sleep(0.01, result=4)",
        "print(first, second, third, fourth)",
    ], allow_errors_in={4})
    last = notebook.cells[-1].outputs
    assert any(o.get("text", "").strip() == "1 2 3 4" for o in last), last
    for cell in notebook.cells[1:4]:
        assert not [o for o in cell.outputs if o.get("output_type") == "error"], cell.outputs


def test_the_awaiting_body_sees_the_cells_grad_mode(shell):
    torch = pytest.importorskip("torch")
    shell.user_ns["torch"] = torch
    try:
        torch.set_grad_enabled(False)
        run_in_a_loop(shell, "%%cudamem\nimport asyncio\nawait asyncio.sleep(0)\ngrad_there = torch.is_grad_enabled()")
    finally:
        torch.set_grad_enabled(True)
    assert shell.user_ns["grad_there"] is False
