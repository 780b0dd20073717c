"""Benchmark: what decides whether a batch fits near its limit, per workload of ``benchmarks/oomfix.py``.

``%oomfix`` predicts the largest batch from the *allocated* peaks of its tries. A cap limits *reserved*
memory, and what PyTorch's caching allocator reserves beyond what is allocated near the limit differs
by workload. This measures, for each workload, around the largest fitting batch (the oracle of
``results/oomfix_sweep_2026-11-27_one_run.json``, found by bisection in a fresh namespace):

1. **fresh**: each run in a fresh namespace with the cache emptied (as the oracle's probes), at
   ``FRESH`` x the oracle: fitted or not, the allocated and reserved peaks above the cell's start, the
   peak of ``inactive_split_bytes`` (free pieces of split blocks), and for an OOM the figures of its
   message as ``%oomfix`` parses them: what was allocated, what was reserved but unallocated (the
   pieces PyTorch could not use for the allocation: ``stuck``) and what was asked for;
2. **warm**: a run at 0.3x the oracle, then, without emptying the cache, one at ``WARM`` x the oracle:
   the limit as a notebook meets it after smaller runs.

Derived per workload (``derived``): the room the cap left above the cell's start, over the allocated
peak at the oracle (how much more than its allocated bytes the step needs there), and the stuck
bytes of the failures just above the limit.

Run on the GPU machine in parts (each under a minute and a half; parts may run at the same time,
each to its own file), then merge::

    python benchmarks/fit_limit.py --part 1/3 --out part1.json
    python benchmarks/fit_limit.py --merge part1.json part2.json part3.json
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import oomfix as sweep  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "fit_limit.json"
FRESH = (0.3, 0.6, 0.95, 1.0, 1.02, 1.05, 1.1, 1.5)
"""Around the limit closely (the margin a prediction needs), and far enough below and above it to see
how the figures scale."""
WARM = (0.95, 1.0, 1.05)
WARM_BEFORE = 0.3
"""A smaller run first, as a notebook's earlier cells or ``%oomfix``'s own probe would be."""


def run_once(bench: Any, torch: Any, workload: sweep.Workload, batch: int, fresh: bool = True) -> dict[str, Any]:
    """One run of the cell at ``batch``: a fresh namespace and emptied cache first when ``fresh``."""
    from jupyter_cudamem.oom import parse_oom

    if fresh:
        bench._setup(workload)
    knob = workload.knob_at(batch, "cuda")
    if knob and bench.run(knob) is not None:
        raise RuntimeError(f"{workload.name}: the knob cell failed at {batch}")
    if fresh:
        gc.collect()
        torch.cuda.empty_cache()
    start_allocated, start_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    error = bench.run(workload.cell_at(batch, "cuda"))
    stats = torch.cuda.memory_stats()
    record: dict[str, Any] = {
        "batch": batch, "fitted": error is None, "start_allocated_bytes": start_allocated,
        "allocated_peak_bytes": torch.cuda.max_memory_allocated() - start_allocated,
        "reserved_peak_bytes": torch.cuda.max_memory_reserved() - start_reserved,
        "inactive_split_peak_bytes": stats.get("inactive_split_bytes.all.peak"),
    }
    if error is not None:
        oom = parse_oom(error)
        if oom is None:
            raise RuntimeError(f"{workload.name} failed otherwise at {batch}: {type(error).__name__}: {str(error)[:200]}")
        record.update(oom_allocated_bytes=oom.allocated_bytes, oom_stuck_bytes=oom.reserved_unallocated_bytes,
                      oom_asked_bytes=oom.requested_bytes)
    del error
    return record


def measure(bench: Any, torch: Any, workload: sweep.Workload, oracle: int, cap_bytes: int) -> dict[str, Any]:
    fresh = []
    for ratio in FRESH:
        fresh.append({"ratio": ratio, **run_once(bench, torch, workload, max(int(ratio * oracle), 1))})
        bench.release()
    warm = []
    for ratio in WARM:
        before = run_once(bench, torch, workload, max(int(WARM_BEFORE * oracle), 1))
        after = run_once(bench, torch, workload, int(ratio * oracle), fresh=False)
        warm.append({"ratio": ratio, "before_fitted": before["fitted"], **after})
        bench.release()
    at_limit = next(r for r in fresh if r["ratio"] == 1.0)
    room = cap_bytes - at_limit["start_allocated_bytes"]
    above = [r for r in fresh if not r["fitted"] and 1.0 < r["ratio"] <= 1.1]
    derived = {
        "fits_at_oracle_fresh": at_limit["fitted"],
        "room_over_allocated_peak_at_oracle": round(room / at_limit["allocated_peak_bytes"], 4)
        if at_limit["fitted"] and at_limit["allocated_peak_bytes"] else None,
        "stuck_bytes_just_above": [r.get("oom_stuck_bytes") for r in above],
        "warm_fits": {str(r["ratio"]): r["fitted"] for r in warm},
    }
    return {"oracle_batch": oracle, "fresh": fresh, "warm": warm, "derived": derived}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", default="1/1", help="K/N: the K-th of N parts of the workloads")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--cap-gib", type=float, default=sweep.CAP_GIB)
    parser.add_argument("--merge", nargs="+", metavar="PART", help="merge parts' files into --out and exit")
    args = parser.parse_args(argv)
    if args.merge:
        # The sweep's merge: each part's workloads and timing join the first part's file.
        merged = functools.reduce(sweep.merge, (json.loads(Path(part).read_text()) for part in args.merge))
        merged.pop("cases", None)  # the sweep's list of cases; this benchmark has none
        Path(args.out).write_text(json.dumps(merged, indent=1) + "\n")
        return 0
    import torch

    if not torch.cuda.is_available():
        parser.error("no CUDA device: run on the GPU machine")
    oracles = {name: info["oracle_batch"] for name, info in
               json.loads(sweep.SINGLE_RUN_RESULTS.read_text())["workloads"].items() if info.get("oracle_batch")}
    names = sweep.select_part([w.name for w in sweep.WORKLOADS if w.name in oracles], args.part)
    torch.cuda.init()
    cap_bytes = int(args.cap_gib * 2**30)
    torch.cuda.set_per_process_memory_fraction(min(cap_bytes / torch.cuda.get_device_properties(0).total_memory, 1.0), 0)
    torch.zeros(1, device="cuda")
    bench = sweep.ShellBench("cuda")
    out = Path(args.out)
    results: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    results.update(sweep.environment("cuda", cap_bytes))
    results.pop("ratios", None)
    results["oracles_from"] = f"benchmarks/results/{sweep.SINGLE_RUN_RESULTS.name} of {json.loads(sweep.SINGLE_RUN_RESULTS.read_text())['date']}"
    results.setdefault("workloads", {})
    started = time.perf_counter()
    try:
        for name in names:
            workload = next(w for w in sweep.WORKLOADS if w.name == name)
            results["workloads"][name] = measure(bench, torch, workload, oracles[name], cap_bytes)
            sweep.say(f"{name}: {results['workloads'][name]['derived']}")
    finally:
        bench.close()
    results.setdefault("parts", {})[args.part] = {"workloads": names, "seconds": round(time.perf_counter() - started, 1)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
