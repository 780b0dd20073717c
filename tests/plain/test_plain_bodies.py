"""Class 3 of issue 11: a ``%%cudamem`` or ``%%oomfix`` body behaves as a plain cell for everything
IPython accepts, compared with IPython's own ``run_cell`` of the same body in the same shell."""

from __future__ import annotations

import pytest

from tests.plain.forms import Observed, baseline, bodies, same_as_plain

BODIES = bodies()
MAGICS = ("%%cudamem -q", "%%oomfix --yes")


def test_the_forms_are_many():
    assert len(BODIES) >= 400  # the closing note reports this count


@pytest.mark.parametrize("body", BODIES, ids=[f"{i:03d}" for i in range(len(BODIES))])
def test_body_runs_as_a_plain_cell(shell, capsys, body):
    if body == "":
        # IPython itself refuses every cell magic with an empty body, before our code runs.
        result = shell.run_cell("%%cudamem\n", store_history=True)
        assert "cell body is empty" in str(result.error_in_exec)
        return
    saved = baseline(shell)
    plain = Observed.run(shell, body, capsys, saved)
    for magic in MAGICS:
        under = Observed.run(shell, f"{magic}\n{body}", capsys, saved)
        assert same_as_plain(plain, under) == [], f"{magic} differs from a plain cell for {body!r}"
