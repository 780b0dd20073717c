"""A body's error leaves our magics as it leaves ``%time`` (jupyter_cudamem/magics/cellrun.py ``Ran.fail``):
raised from the line form and from ``run_line_magic``/``run_cell_magic`` called in code, so the code after
it does not run and ``try``/``except`` catches it; shown once, at the user's frame, in every case."""

from __future__ import annotations

import _thread
import asyncio
import re
import signal
import sys
import threading
import time

import pytest

_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


def shown(capsys) -> str:
    captured = capsys.readouterr()
    return _COLOUR.sub("", captured.out + captured.err)


@pytest.fixture(autouse=True)
def clean_names(shell):
    for name in ("after", "caught", "fitted", "tried"):
        shell.user_ns.pop(name, None)
    yield


@pytest.mark.parametrize("options", ["", "-q", "-o", "-q --no-reset-peak"])
def test_the_line_form_stops_the_cell_and_shows_the_error_once(shell, capsys, options):
    result = shell.run_cell(f"%cudamem {options} 1/0\nafter = True\nprint('after')", store_history=True)
    assert isinstance(result.error_in_exec, ZeroDivisionError)
    assert "after" not in shell.user_ns
    text = shown(capsys)
    assert text.count("ZeroDivisionError: division by zero") == 1
    assert "----> 1 1/0" in text  # the user's line
    assert "jupyter_cudamem" not in text and "cellrun" not in text and "\nafter\n" not in text


def test_try_except_around_the_line_form_catches_the_error(shell, capsys):
    result = shell.run_cell(
        "try:\n    %cudamem -q 1/0\nexcept ZeroDivisionError as error:\n    caught = error\nafter = True",
        store_history=True,
    )
    assert result.success
    assert isinstance(shell.user_ns["caught"], ZeroDivisionError) and shell.user_ns["after"] is True
    assert "Traceback" not in shown(capsys)


def test_a_loop_trying_batches_finds_the_one_that_fits(shell):
    """The issue's loop: 6000 and 3000 raise, so 700 is the batch that fitted (6000 was reported before)."""
    shell.user_ns["step"] = lambda batch: 1 if batch <= 1000 else (_ for _ in ()).throw(MemoryError(batch))
    result = shell.run_cell(
        "tried = []\nfor b in [6000, 3000, 700]:\n    tried.append(b)\n    try:\n        %cudamem -q step(b)\n"
        "    except MemoryError:\n        continue\n    fitted = b\n    break",
        store_history=True,
    )
    assert result.success, result.error_in_exec
    assert shell.user_ns["fitted"] == 700 and shell.user_ns["tried"] == [6000, 3000, 700]


def test_a_failed_statement_binds_nothing_and_the_write_after_it_does_not_run(shell, tmp_path):
    """The issue's data loss: ``%cudamem result = ...`` failed, and the file write after it kept a stale value."""
    target = tmp_path / "result.txt"
    target.write_text("kept")
    shell.user_ns.update(result="stale", target=target)
    shell.run_cell("%cudamem -q result = str(1/0)\ntarget.write_text(result)", store_history=True)
    assert target.read_text() == "kept" and shell.user_ns["result"] == "stale"


CALLS = [
    "run_line_magic('cudamem', '1/0')",
    "run_line_magic('cudamem', '-q -o 1/0')",
    "run_cell_magic('cudamem', '', '1/0')",
    "run_cell_magic('cudamem', '-q', 'x = 1\\n1/0')",
    "run_cell_magic('cudamem_plan', '', '1/0')",
    "run_cell_magic('oomfix', '--yes', '1/0')",
    "run_cell_magic('oomfix', '--dry-run', '1/0')",
]


@pytest.mark.parametrize("call", CALLS)
def test_a_magic_called_in_a_cell_raises_there(shell, capsys, call):
    result = shell.run_cell(f"get_ipython().{call}\nafter = True", store_history=True)
    assert isinstance(result.error_in_exec, ZeroDivisionError)
    assert "after" not in shell.user_ns
    text = shown(capsys)
    assert text.count("ZeroDivisionError: division by zero") == 1 and "1/0" in text
    assert "jupyter_cudamem" not in text
    result = shell.run_cell(f"try:\n    get_ipython().{call}\nexcept ZeroDivisionError:\n    caught = True",
                            store_history=True)
    assert result.success and shell.user_ns["caught"] is True
    assert "Traceback" not in shown(capsys)


@pytest.mark.parametrize("call", CALLS)
def test_a_magic_called_from_python_raises(shell, call):
    with pytest.raises(ZeroDivisionError):
        eval(f"shell.{call}", {"shell": shell})


def test_a_magic_called_inside_a_cell_magic_of_ours_raises_into_its_body(shell, capsys):
    result = shell.run_cell(
        "%%cudamem -q\nget_ipython().run_cell_magic('cudamem', '-q', '1/0')\nafter = True", store_history=True
    )
    assert isinstance(result.error_in_exec, ZeroDivisionError) and "after" not in shell.user_ns
    text = shown(capsys)
    assert text.count("ZeroDivisionError: division by zero") == 1 and "jupyter_cudamem" not in text


def test_the_cell_magic_shows_the_error_as_a_plain_cell_and_fails_the_cell(shell, capsys):
    plain = shell.run_cell("x = 1\n1/0", store_history=True)
    plain_text = re.sub(r"\[\d+\]", "[N]", shown(capsys))
    result = shell.run_cell("%%cudamem -q\nx = 1\n1/0", store_history=True)
    assert isinstance(result.error_in_exec, ZeroDivisionError) and not shell.last_execution_succeeded
    assert re.sub(r"\[\d+\]", "[N]", shown(capsys)) == plain_text  # no run_cell_magic line, no frame of ours
    assert isinstance(plain.error_in_exec, ZeroDivisionError)


def test_dry_run_called_from_code_shows_the_plan_before_raising(shell, capsys):
    body = "m.allocate(0, 100 * GiB)"
    with pytest.raises(Exception, match="CUDA out of memory"):
        shell.run_cell_magic("oomfix", "--dry-run", body)
    assert re.search(r"dry.run", shown(capsys), re.IGNORECASE)  # the preview came before the error


def test_the_dry_run_of_a_cell_magic_names_the_cell_it_runs_in(shell, capsys):
    # IPython 9 counts the cell before running it: ``execution_count`` is the next cell's number there.
    result = shell.run_cell("%%oomfix --dry-run\nm.allocate(0, 100 * GiB)", store_history=True)
    text = shown(capsys)
    assert result.execution_count is not None and f"In[{result.execution_count}] ran out of GPU memory" in text, text


def _interrupted(shell, cell: str):
    """Run ``cell`` as ipykernel does, inside an event loop, and interrupt it once it awaits: once, after
    the cell imported asyncio, this thread waits for the body awaited beside it (``cellrun._wait_for``)
    and that body's loop waits on its selector for the sleep. A fixed delay, on a loaded machine, came
    before the cell got there."""
    runner = threading.get_ident()

    def where(frame) -> tuple[str, str]:
        return frame.f_code.co_name, frame.f_code.co_filename.rsplit("/", 1)[-1]

    def interrupt_once_awaiting() -> None:
        for _ in range(3000):
            frames = sys._current_frames()
            # A loop's first select, before the task's first step, has timeout 0: the body has not awaited.
            selecting = any(where(f) == ("select", "selectors.py") and f.f_locals.get("timeout", 0) != 0
                            for f in frames.values())
            if "asyncio" in shell.user_ns and selecting and "_wait_for" in _names(frames.get(runner)):
                _thread.interrupt_main()
                return
            time.sleep(0.005)

    watcher = threading.Thread(target=interrupt_once_awaiting, daemon=True)
    shell.user_ns.pop("asyncio", None)
    # Python's own SIGINT handler, as in a kernel: a test run before this one in the same process (a kernel
    # client's cleanup) may have left one that swallows the interrupt.
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    watcher.start()
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(_run(shell, cell))
    finally:
        loop.close()
        watcher.join()
        signal.signal(signal.SIGINT, handler)


def _names(frame) -> set[str]:
    names = set()
    while frame is not None:
        names.add(frame.f_code.co_name)
        frame = frame.f_back
    return names


async def _run(shell, cell):
    return shell.run_cell(cell, store_history=True)


@pytest.mark.parametrize("cell", [
    "%%cudamem -q\nimport asyncio\nawait asyncio.sleep(20)\nafter = True",
    "import asyncio\n%cudamem -q await asyncio.sleep(20)\nafter = True",
])
def test_an_interrupt_while_awaiting_is_the_users_cancelled_error(shell, capsys, cell):
    result = _interrupted(shell, cell)
    assert isinstance(result.error_in_exec, asyncio.CancelledError), result.error_in_exec
    assert "after" not in shell.user_ns
    text = shown(capsys)
    assert "await asyncio.sleep(20)" in text  # at the user's line
    assert "jupyter_cudamem" not in text and "threading" not in text and "KeyboardInterrupt" not in text


@pytest.mark.parametrize("options", ["", "-q"])
@pytest.mark.parametrize("body", ["def f(:", "return 1"])  # one does not parse, one parses but does not compile
def test_a_line_form_that_does_not_compile_shows_what_a_plain_cell_shows(shell, capsys, body, options):
    plain = shell.run_cell(body, store_history=True)
    plain_text = re.sub(r"\[\d+\]", "[N]", shown(capsys))
    result = shell.run_cell(f"%cudamem {options} {body}", store_history=True)
    assert isinstance(result.error_in_exec, SyntaxError) and not shell.last_execution_succeeded
    assert re.sub(r"\[\d+\]", "[N]", shown(capsys)) == plain_text  # the SyntaxError alone: no frame at all
    assert isinstance(plain.error_before_exec or plain.error_in_exec, SyntaxError)


@pytest.mark.parametrize("cell", ["%cudamem def f(:\nafter = True", "after = %cudamem def f(:"])
def test_a_line_form_that_does_not_compile_with_code_around_it_raises_there(shell, capsys, cell):
    result = shell.run_cell(cell, store_history=True)
    assert isinstance(result.error_in_exec, SyntaxError) and "after" not in shell.user_ns
    text = shown(capsys)
    assert text.count("SyntaxError: invalid syntax") == 1
    assert text.count("jupyter_cudamem") <= 1  # the magic's own frame; %time shows two of its own
    result = shell.run_cell("try:\n    %cudamem def f(:\nexcept SyntaxError:\n    caught = True", store_history=True)
    assert result.success and shell.user_ns["caught"] is True
