"""The leaks benchmark's cases, run on CPU tensors (``--cpu-smoke``), so its GPU run works first time:
every classic leak named with its cause and advice, no result called a leak, results written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.benchmark_smoke

REPO = Path(__file__).resolve().parents[1]


def test_cpu_smoke_run_names_every_case(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "leaks.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "leaks.py"), "--cpu-smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    results = json.loads(out.read_text())
    assert {"device", "versions", "date", "cases", "cost", "goals"} <= set(results)
    cases = {case["case"]: case for case in results["cases"]}
    assert len(cases) >= 10 and all(case["passed"] for case in cases.values())
    leaks = [case for case in cases.values() if case["leak"]]
    assert len(leaks) >= 7 and all(case["flagged_leak"] for case in leaks)
    assert not any(case["flagged_leak"] for case in cases.values() if not case["leak"])
    for case in cases.values():
        assert {
            "case",
            "leak",
            "flagged_leak",
            "expected_holder",
            "named_holders",
            "left_bytes",
            "attributed_bytes",
            "attribution_ms",
        } <= set(case)
    assert results["goals"]["every_leak_named_with_90_percent_attributed"]
    assert results["goals"]["no_result_called_a_leak"]
    assert all(cost["named"] == ["leaked"] for cost in results["cost"].values())
    assert "[12/12]" in done.stdout
    assert cases["dict_held_list"]["named_holders"][0]["name"] == "history['losses']"


CHECK_IN_A_SHELL = r"""
import contextlib, io, json, sys
sys.path[:0] = ["."]
from benchmarks.leaks import CASES, PRELUDE, _run, _shell
from tests.gpu.test_leaks_gpu import CHECK

shell, _ = _shell(cpu_smoke=True)
case = next(c for c in CASES if c.name == "losses_list")
_run(shell, PRELUDE.format(dev="cpu", batch=128, width=256))
_run(shell, "%%cudamem -o\n7 * 6")  # a body ending in an expression: displayed, and the report is the result
assert type(shell.user_ns["_"]).__name__ == "CellReport" and shell.user_ns["__"] == 42
out = io.StringIO()
with contextlib.redirect_stdout(out):
    shell.run_cell("%reset -f out", store_history=True)
    shell.run_cell("%%cudamem -o\n" + case.cell, store_history=True)
    shell.run_cell(CHECK.format(name=case.name), store_history=True)
print(json.dumps({"underscore": repr(shell.user_ns["_"]), "text": out.getvalue()}))
"""


def test_the_gpu_tests_check_cell_finds_the_report_when_the_cell_binds_underscore():
    """``for _ in range(20)`` binds ``_``, after which IPython no longer updates it: the GPU test's check
    cell must find ``%%cudamem -o``'s report in ``Out`` instead (run here in a shell on CPU tensors)."""
    pytest.importorskip("torch")
    done = subprocess.run([sys.executable, "-c", CHECK_IN_A_SHELL], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    shown = json.loads(done.stdout.strip().splitlines()[-1])
    assert shown["underscore"] == "19"  # the user's own _, as IPython leaves it
    record = json.loads(next(line for line in shown["text"].splitlines() if line.startswith("RESULT "))[7:])
    assert record["passed"] and record["named_holders"][0]["name"] == "losses", record
