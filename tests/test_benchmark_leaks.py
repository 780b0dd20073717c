"""The leaks benchmark's cases, run on CPU tensors (``--cpu-smoke``), so its GPU run works first time:
every classic leak named with its cause and advice, no result called a leak, results written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
    assert len(leaks) >= 6 and all(case["flagged_leak"] for case in leaks)
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
    assert "[11/11]" in done.stdout
