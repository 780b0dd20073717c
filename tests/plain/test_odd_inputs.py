"""Issue 41: what the odd-input sweep (``scripts/odd_inputs.py``) found, each a one-line error or a plain cell's
failure, never a frame of ours: a size past a float's range, ``--opt=--`` (an empty list from Python 3.11's
argparse), ``monitor(history_s=10**400)``, a lone surrogate in a body, and ``SystemExit``'s note."""

from __future__ import annotations

import re
import warnings

import pytest
from IPython.core.error import UsageError

import jupyter_cudamem
from jupyter_cudamem.errors import CudaMemError
from jupyter_cudamem.units import parse_size

HUGE = "9" * 400


def one_line(shell, source, capsys):
    result = shell.run_cell(source, store_history=True)
    assert isinstance(result.error_in_exec, UsageError), (source, repr(result.error_in_exec))
    message = str(result.error_in_exec)
    assert "\n" not in message
    shown = capsys.readouterr()
    assert "jupyter_cudamem/" not in shown.out + shown.err and "Traceback" not in shown.out + shown.err
    return message


@pytest.mark.parametrize("limit", (HUGE, HUGE + "GiB", "1" + "0" * 400 + "B", HUGE + ".5MiB"))
@pytest.mark.parametrize("form", ("%cudamem --limit {} x = 1", "%%cudamem --limit={}\nx = 1"))
def test_a_limit_past_a_float_is_one_line(shell, capsys, limit, form):
    shell.user_ns.pop("x", None)
    message = one_line(shell, form.format(limit), capsys)
    assert message.startswith("size too large") and "24GiB" in message and len(message) < 200
    assert "x" not in shell.user_ns  # refused before the cell ran


@pytest.mark.parametrize("size", (10**400, -(10**400), float("inf"), HUGE, HUGE + "TiB"),
                         ids=("1e400", "-1e400", "inf", "400 nines", "400 nines TiB"))
def test_parse_size_refuses_what_no_float_holds(size):
    with pytest.raises(CudaMemError):
        parse_size(size)


DASHES = (
    "%cudamem_history --save=--", "%cudamem_history --last=--", "%cudamem_history --cells=--",
    "%%cudamem_plan --margin=--\nbatch_size = 2", "%%cudamem_plan --cards=--\nbatch_size = 2",
    "%%cudamem_plan --small=--\nbatch_size = 2", "%oomfix --del=-- --dry-run", "%oomfix --max-tries=-- --dry-run",
    "%cudamem -l=-- x = 1", "%cudamem -l-- x = 1", "%%cudamem --device=--\nx = 1", "%cudamem_monitor --interval=--",
    "%cudamem_engines --timeout=--", "%%oomfix --strategy=--\nx = 1",
)


@pytest.mark.parametrize("source", DASHES)
def test_an_option_given_dashes_for_a_value_is_one_line(shell, capsys, source):
    shell.user_ns.pop("x", None)
    message = one_line(shell, source, capsys)
    assert "no value" in message and "write a value after it" in message
    assert "x" not in shell.user_ns


@pytest.mark.parametrize("kwargs", ({"history_s": 10**400}, {"interval_s": 10**400}, {"history_s": -(10**400)}))
def test_monitor_from_python_names_a_number_past_a_float(shell, kwargs):
    with pytest.raises(UsageError) as error:
        jupyter_cudamem.monitor(**kwargs)
    assert next(iter(kwargs)) in str(error.value) and "1e+400" in str(error.value)


def _error_of(shell, source: str) -> BaseException | None:
    """The cell's error: IPython 8.12 raises a lone surrogate's out of ``run_cell`` for a plain cell (its check
    for top-level ``await`` encodes the source), later versions keep it in the result."""
    try:
        return shell.run_cell(source, store_history=False).error_in_exec
    except UnicodeEncodeError as error:
        return error


@pytest.mark.parametrize("head", ("%%cudamem -q", "%%oomfix", "%%cudamem_plan"))
def test_a_lone_surrogate_fails_as_in_a_plain_cell(shell, capsys, head):
    plain = _error_of(shell, "'\udcff'")
    capsys.readouterr()
    ours = _error_of(shell, f"{head}\n'\udcff'")
    shown = capsys.readouterr()
    assert type(ours) is type(plain) is UnicodeEncodeError
    assert "jupyter_cudamem/" not in shown.out + shown.err


@pytest.mark.parametrize("head", ("%%cudamem", "%%oomfix", "%%cudamem_plan"))
def test_system_exit_notes_no_line_of_ours(shell, head):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = shell.run_cell(f"{head}\nraise SystemExit('bye')", store_history=True)
    assert isinstance(result.error_in_exec, SystemExit)
    places = [w.filename for w in caught if "To exit" in str(w.message)]
    assert places and not any("jupyter_cudamem" in place for place in places), places


RAISED_AS_IT_PASSES = (
    "raise ExceptionGroup('g', [ValueError(1)])",
    "raise BaseExceptionGroup('g', [KeyError(2)])",
    "compile('x = (', 'f', 'exec')",
    "raise IndentationError('i')",
    "'\udcff'",
)


@pytest.mark.parametrize("statement", RAISED_AS_IT_PASSES)
def test_the_line_form_shows_one_frame_of_ours_where_ipython_shows_every_frame(shell, capsys, statement):
    """IPython prints every frame an exception group or a SyntaxError passed through, and the last frame of an
    error with no frame of the body's: raised from the magic's own frame, one of ours is shown, as for a body
    that does not compile."""
    shell.user_ns.pop("after", None)
    result = shell.run_cell(f"%cudamem -q {statement}\nafter = 1", store_history=False)
    shown = capsys.readouterr()
    assert result.error_in_exec is not None and "after" not in shell.user_ns
    ours = re.findall(r"jupyter_cudamem/[\w/]+\.py", shown.out + shown.err)
    # IPython 8.12 hides the magic's frame of an exception group too ("skipping hidden 1 frame").
    assert ours in ([], ["jupyter_cudamem/magics/base.py"]), ours


def test_a_syntax_error_raised_from_the_line_form_keeps_its_own_context(shell):
    shell.run_cell("def f():\n    try:\n        1/0\n    except ZeroDivisionError:\n        raise SyntaxError('s')",
                   store_history=False)
    shell.run_cell("try:\n    %cudamem -q f()\nexcept SyntaxError as caught:\n    seen = caught", store_history=False)
    seen = shell.user_ns.pop("seen")
    assert isinstance(seen.__context__, ZeroDivisionError) and not seen.__suppress_context__


@pytest.mark.parametrize("refused", ("CudaMem.reset_peak = 1.0", "CudaMem.history_size = 0",
                                     "CudaMemMonitor.interval_s = 0.001", "OomFix.margin = float('nan')",
                                     "CudaMemEngines.timeout_s = 10**400"))
def test_a_setting_config_refused_does_not_stop_the_next_load(shell, hardware, capsys, refused):
    """IPython keeps a value ``%config`` refused in the shell's config: loading the extension again applied it,
    and ``%reload_ext`` stopped with a TraitError's traceback, leaving no magic of ours."""
    from jupyter_cudamem import magics

    shell.run_cell(f"%config {refused}", store_history=True)
    shell.run_cell("%config CudaMem.verbose = True", store_history=True)
    capsys.readouterr()
    magics.unload(shell)
    extension = magics.load(shell, hardware)
    owner, name = refused.split(" = ")[0].split(".")
    told = capsys.readouterr().err
    assert f"{owner}.{name} = " in told and "left out" in told and len(told.strip().splitlines()) == 1, told
    assert extension.magics[0].verbose is True  # the settings that were fine are kept
    kind = type(next(m for m in extension.magics if type(m).__name__ == owner))
    assert sum(isinstance(c, kind) for c in shell.configurables) == 1  # not the instance whose settings failed
    assert shell.run_cell("%cudamem status", store_history=True).success


@pytest.mark.parametrize("name", ("__builtins__", "__builtin__"))
@pytest.mark.parametrize("form", ("%oomfix --yes --del {}", "%%oomfix --yes --del {}\nbatch_size = 8\nran = True"))
def test_del_of_a_name_ipython_never_deletes_is_one_line_before_anything_runs(shell, capsys, name, form):
    """IPython's ``del_var`` raises ValueError for these: that came through our frames after the cleanup began."""
    shell.run_cell("batch_size = 64\nm.allocate(0, 500 * GiB)", store_history=True)
    shell.user_ns.pop("ran", None)
    capsys.readouterr()
    message = one_line(shell, form.format(name), capsys)
    assert message == f"--del {name}: IPython never deletes it (the shell needs it); nothing was deleted"
    assert "ran" not in shell.user_ns  # the cell form refuses before running its body
