"""The overhead benchmark run small over the fakes (``--cpu-smoke --quick``), so the GPU run works first
time: every mode of ours and IPython's %%time timed beside the bare cell, at every namespace size, with
the goals of issue 42 written, and the every-cell mode's snapshot at 10,000 names as cheap as at none."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.benchmark_smoke

REPO = Path(__file__).resolve().parents[1]


def test_cpu_smoke_run_records_every_mode_and_size(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "overhead.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "overhead.py"), "--cpu-smoke", "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    results = json.loads(out.read_text())
    assert {"date", "python", "torch", "ipython", "device"} <= set(results["environment"])
    modes = results["modes"]
    for name in ("bare", "cudamem_cell_magic", "cudamem_every_cell", "reference_ipython_time_cell_magic"):
        assert modes[name]["error"] is None and modes[name]["trivial"]["n"] > 0, name
    assert {"ipython_autotime", "ipyexperiments"} <= set(modes)  # timed, or their error recorded
    # Per cell, over the fakes' one device: the counters and a synchronization at each end, one peak reset,
    # NVML's memory at each end, and no process list while the device's used memory stands; no cap, asked only
    # of a device the cell touched (the small kernels run on CPU tensors here).
    each_end = {"allocator.synchronize": 2, "allocator.read": 2, "allocator.reset_peak": 1, "nvml.memory": 2}
    for mode in ("cudamem_cell_magic", "cudamem_every_cell"):
        assert results["hardware_calls_per_cell"][mode] == {"trivial": each_end, "small_kernels": each_end}
    sizes = results["namespaces"]["sizes"]
    assert set(sizes) == {"0", "1000", "10000"}
    for entry in sizes.values():
        assert entry["modes"]["cudamem_every_cell"]["error"] is None
    # The kept snapshot does not grow with the namespace: a full one at 10,000 names costs many times more.
    kept = sizes["10000"]["kept_snapshot_ms"]["median_ms"]
    assert kept < sizes["10000"]["snapshot_ms"]["median_ms"] / 10
    assert "at_most_0.10ms_over_ipython_time" in results["goals"]["cudamem_cell_magic/trivial"]
    assert "at_most_0.10ms" in results["goals"]["cudamem_every_cell/trivial"]
    assert "at_most_0.5ms" in results["goals"]["cudamem_every_cell/trivial/10000_names"]
