"""benchmarks/parallel.py on the CPU (``--dry-run``: two engines over the fake card of tests/engine_fakes.py), so its
GPU run works first time: the result names each engine, and what the client's table shows is what each engine
measured itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.benchmark_smoke

REPO = Path(__file__).resolve().parents[1]
GiB = 1024**3


def test_dry_run_writes_engines_that_agree_with_the_client(tmp_path):
    pytest.importorskip("ipyparallel", reason="needs the parallel extra: pip install '.[parallel]'")
    out = tmp_path / "parallel.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "parallel.py"), "--dry-run", "--engines", "2", "--repeats", "2",
         "--monitor-s", "0.5", "--out", str(out)],
        capture_output=True, text=True, timeout=240, cwd=REPO,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    results = json.loads(out.read_text())
    assert {"device", "versions", "date", "engines", "gathering", "monitor"} <= set(results)
    engines = results["engines"]
    # Engine k of the fake workload peaks at k + 2 GiB (k + 1 held, one more passing through).
    assert [(e["engine"], e["engine_peak_bytes"], e["client_peak_bytes"]) for e in engines] == [(0, 2 * GiB, 2 * GiB), (1, 3 * GiB, 3 * GiB)]
    assert len({e["pid"] for e in engines}) == 2 and len({e["device_uuid"] for e in engines}) == 1
    assert results["engine_and_client_agree"] is True
    assert results["gathering"]["gather_alone_s"]["n"] == 2
    assert [row["status"] for row in results["monitor"]["engines"]] == ["live", "live"]
