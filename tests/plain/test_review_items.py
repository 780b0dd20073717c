"""Review items of issue 11: the user's error survives a failing counter read; %oomfix restores
``showtraceback`` to what was there; a trailing ``;`` follows IPython's display hook rule."""

from __future__ import annotations

import pytest

import jupyter_cudamem.magics as magics
from jupyter_cudamem.errors import CudaMemError
from jupyter_cudamem.magics.cellrun import semicolon_at_end
from jupyter_cudamem.magics.oomfix import OomFix
from jupyter_cudamem.measure import Meter


@pytest.mark.parametrize("failure", (CudaMemError("CUDA error: an illegal memory access"), RuntimeError("sticky")))
@pytest.mark.parametrize("body, kind", (("raise ValueError('mine')", ValueError), ("1/0", ZeroDivisionError)))
def test_the_users_error_is_shown_when_reading_the_counters_fails(shell, monkeypatch, capsys, failure, body, kind):
    def stop(*args, **kwargs):
        raise failure

    monkeypatch.setattr(Meter, "stop", stop)
    result = shell.run_cell(f"%%cudamem\n{body}", store_history=True)
    assert isinstance(result.error_in_exec, kind)
    captured = capsys.readouterr()
    assert "could not read GPU memory after the cell" in captured.err and kind.__name__ in captured.out


@pytest.mark.parametrize("own", (True, False))
def test_oomfix_puts_back_the_showtraceback_that_was_there(shell, own):
    magic = magics.loaded(shell).get(OomFix)
    mine = lambda *a, **k: None  # noqa: E731
    if own:
        shell.showtraceback = mine
    try:
        with magic.reruns.quiet_oom_tracebacks():
            assert vars(shell)["showtraceback"] is not mine
        assert (vars(shell).get("showtraceback") is mine) if own else ("showtraceback" not in vars(shell))
    finally:
        vars(shell).pop("showtraceback", None)


@pytest.mark.parametrize(
    "source, quiet",
    (("x;", True), ("x;  # note", True), ("x ;  ", True), ("x; # a; b", True), ("x", False), ("'a;'", False),
     ("x  # ;", False), ("f(';')", False), ("x;\n# trailing comment\n", True), ("", False)),
)
def test_a_trailing_semicolon_follows_ipythons_rule(source, quiet):
    assert semicolon_at_end(source) is quiet
