"""Benchmark: how much of a capped card each sweep workload can really allocate, and where the line breaks.

For every workload of ``benchmarks/oomfix.py`` (same setup cells, same cell), PyTorch capped at 6 GiB as in
the sweep, the cell runs in a plain namespace at fixed fractions of the sweep's largest fitting batch
(read from ``benchmarks/results/oomfix_sweep_2026-11-27_one_run.json``), each run after ``gc.collect()`` and
``empty_cache()`` with the peak statistics reset. Recorded per run: whether it fitted, the allocated,
reserved, active and inactive-split peaks, PyTorch's count of allocation retries (the allocator freeing
its cache under the cap and trying again), and the error.

What it answers, for ``%oomfix``'s search (``jupyter_cudamem/batchsearch.py``): the search aims at the
budget less a 4% margin on a line through *allocated* peaks. Where the largest batch that fits reaches
95-99% of the cap in allocated bytes (the convnets, BERT), that holds. Measured on the H100
(``benchmarks/results/usable_memory.json``): the GRU's allocated peak grew by 5.5 MiB per sample up to
959 (87.6% of the cap), and at 1009 it asked for one more 1.14 GiB block with 5025 MiB allocated, a
step in the curve no line through smaller batches shows; the MLP that builds its own model and Adam
fitted at 85% of the cap at every batch tried, its slope rising with the batch.

Writes ``benchmarks/results/usable_memory.json`` ({device, versions, date, cap_bytes, workloads: {name:
[runs]}}). Run on the GPU machine (under a minute on an H100)::

    python benchmarks/usable_memory.py
    python benchmarks/usable_memory.py gru_config_dict_from_earlier_cell,lstm_language_model
"""

from __future__ import annotations

import datetime
import gc
import json
import platform
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.oomfix import WORKLOADS, missing_module  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "usable_memory.json"
CAP_BYTES = 6 * 2**30
SWEEP = REPO / "benchmarks" / "results" / "oomfix_sweep_2026-11-27_one_run.json"


def sweep_oracles() -> dict[str, int]:
    """The sweep's largest fitting batch per workload (its oracle, a bisection in an IPython shell)."""
    workloads = json.loads(SWEEP.read_text())["workloads"]
    return {name: info["oracle_batch"] for name, info in workloads.items() if "oracle_batch" in info}


FRACTIONS = (0.05, 0.3, 0.6, 0.85, 0.95, 1.0, 1.04)
"""From a probe-sized batch to just past the sweep's largest: where the search's tries land."""


def run_workload(workload, oracle: int, dev: str = "cuda") -> list[dict]:
    namespace: dict = {}
    for cell in workload.setup_cells(dev):
        exec(cell, namespace)
    keep = set(namespace)
    rows = []
    for fraction in FRACTIONS:
        batch = max(1, round(oracle * fraction))
        for name in [n for n in namespace if n not in keep]:
            del namespace[name]
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_stats()
        error = None
        try:
            if workload.knob:
                exec(workload.knob_at(batch, dev), namespace)
            exec(workload.cell_at(batch, dev), namespace)
        except Exception as failure:  # the cell's OOM is the measurement
            error = f"{type(failure).__name__}: {str(failure)[:160]}"
        stats = torch.cuda.memory_stats()
        rows.append({
            "fraction": fraction, "batch": batch, "fitted": error is None,
            "allocated_at_start_bytes": before["allocated_bytes.all.current"],
            "reserved_at_start_bytes": before["reserved_bytes.all.current"],
            "allocated_peak_bytes": stats["allocated_bytes.all.peak"],
            "reserved_peak_bytes": stats["reserved_bytes.all.peak"],
            "active_peak_bytes": stats["active_bytes.all.peak"],
            "inactive_split_peak_bytes": stats["inactive_split_bytes.all.peak"],
            "alloc_retries": stats["num_alloc_retries"] - before["num_alloc_retries"],
            "error": error,
        })
        row = rows[-1]
        print(f"{workload.name[:28]:28} x{fraction:<5} {batch:>7} {'fits' if row['fitted'] else 'OOM ':5} "
              f"allocated {row['allocated_peak_bytes'] / 2**20:7.0f} MiB reserved {row['reserved_peak_bytes'] / 2**20:7.0f} MiB "
              f"({row['allocated_peak_bytes'] / CAP_BYTES:.1%} / {row['reserved_peak_bytes'] / CAP_BYTES:.1%} of the cap)",
              flush=True)
    namespace.clear()
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def main(argv: list[str]) -> int:
    oracles = sweep_oracles()
    names = argv[0].split(",") if argv else list(oracles)
    torch.cuda.init()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(CAP_BYTES / total, 0)
    results = {
        "device": torch.cuda.get_device_name(0),
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cap_bytes": CAP_BYTES,
        "oracle_batches": oracles,
        "workloads": {},
    }
    for workload in WORKLOADS:
        if workload.name not in names or workload.name not in oracles:
            continue
        reason = missing_module(workload)
        results["workloads"][workload.name] = {"skipped": reason} if reason else run_workload(workload, oracles[workload.name])
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
