"""The batch finder on a corpus of notebooks in the styles people learn from (``tests/oomfix/cells/``).

Every case runs its earlier cells in a real ``InteractiveShell`` (tiny stand-ins for datasets, weights
and the libraries, ``tests/oomfix/standins.py``), runs the failing cell until its first module call
raises a CUDA OOM, then asks the finder as ``%oomfix`` does, with the shell's namespace and input
history. Each case must find the expected knob with its value and the lines a fix rewrites (or
nothing, for cells with nothing to shrink); then the chosen knob is changed to half its batch where
it lives (loaders rebuilt, fields and variables set, Trainer arguments and defaults changed), checked
there and in the diffs, and put back.

The ``adversarial`` cases were written after the finder worked, not designed around it.
"""

from __future__ import annotations

import collections
import gc

import pytest

from tests.oomfix.corpus import Result, load_cases, run_case

CASES = load_cases()


@pytest.fixture(scope="module")
def results() -> dict[str, Result]:
    """Each case's result. After each, what survives a collection is frozen (as ``tests/conftest.py`` does
    between modules): the first optimizer a case builds imports torch's compiler, and each later case's
    shell reset (``gc.collect()``) walked all of it, most of the corpus's time."""
    found = {}
    for case in CASES:
        found[case.name] = run_case(case)
        gc.collect()
        gc.freeze()
    return found


def test_the_corpus_is_big_enough_and_varied():
    first = [c for c in CASES if c.batch == "first"]
    assert len(first) >= 50 and len([c for c in CASES if c.batch == "adversarial"]) >= 10
    styles = {c.name.split("_", 1)[0].rstrip("0123456789") for c in first}
    assert {"pt", "hf", "timm", "tv", "pl", "diff", "nano", "kg"} <= styles
    assert sum(c.expect == "none" for c in CASES) >= 5  # cells with nothing to shrink


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_case(case, results):
    result = results[case.name]
    assert not result.errors, f"{case.name}: earlier cells failed: {result.errors}"
    assert result.verdict == "right", (
        f"{case.name}: found {result.found} at {list(result.edits)}, expected {case.expect} at {list(case.edits)}\n"
        f"{result.finding.summary()}"
    )
    assert not result.change_problems, result.change_problems


def test_counts(results, capsys):
    counts = collections.Counter((r.case.batch, r.verdict) for r in results.values())
    with capsys.disabled():
        print(
            "\nbatch finder corpus:",
            ", ".join(f"{batch} {verdict}: {n}" for (batch, verdict), n in sorted(counts.items())),
        )
    assert all(verdict == "right" for _, verdict in counts)
