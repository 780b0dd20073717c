"""benchmarks/replay.py's validation step, on traces made up here (the capture needs a GPU)."""

from __future__ import annotations

import gzip
import importlib.util
import json

import pytest

from tests.fakes import MiB

pytestmark = pytest.mark.benchmark_smoke

spec = importlib.util.spec_from_file_location("bench_replay", "benchmarks/replay.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

CAP = 64 * MiB


def run(fraction, batch):
    """A step of ``batch`` MiB that fits while ``batch`` MiB fits the cap (one tensor, one segment)."""
    size = batch * MiB
    fitted = size <= CAP
    trace = [["alloc", 4096, size, 0], ["free_requested", 4096, size, 0], ["free_completed", 4096, size, 0]]
    if not fitted:
        trace = [["oom", None, size, 0]]
    return {"f": fraction, "batch": batch, "fitted": fitted, "start_alloc": 0, "peak_alloc": size if fitted else 0,
            "peak_reserved": size if fitted else 0, "error": None, "start_segments": [], "trace": trace}


def test_validation_replays_each_run_and_predicts_from_pairs(tmp_path):
    oracle = 64
    data = {"cap_bytes": CAP, "total_bytes": 10 * CAP, "fraction": 0.1, "device": "made up", "date": "now",
            "versions": {"torch": "x"},
            "workloads": {"one_tensor": {"oracle": oracle, "runs": [run(f, max(int(f * oracle), 2)) for f in bench.FRACTIONS]}}}
    path = tmp_path / "part1.json.gz"
    with gzip.open(path, "wt") as handle:
        json.dump(data, handle)
    result = bench.validate([path])
    assert result["summary"]["runs_replayed_to_their_outcome"] == f"{len(bench.FRACTIONS)} of {len(bench.FRACTIONS)}"
    assert [r["replay_fits"] for r in result["runs"]] == [f <= 1.0 for f in bench.FRACTIONS]
    predictions = {tuple(p["pair"]): p for p in result["predictions"]}
    assert predictions[(0.3, 0.6)]["replay_batch"] == oracle and predictions[(0.3, 0.6)]["replay_over_oracle"] == 1.0
    assert result["summary"]["above_oracle"] == 0 and result["traces"][0]["device"] == "made up"
