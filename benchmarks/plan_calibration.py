"""Benchmark: would a capped run calibrate the capacity plan's line? (An experiment; the plan does not do it.)

The capacity plan (``benchmarks/plan.py``) fits its line to PyTorch's allocated peaks of two uncapped runs.
Under a card's cap a cell needs more or less than its uncapped allocated peak: more where the allocator
cannot give back the free parts of segments that still hold live blocks, less where a library sizes an
optional workspace by what is free (cuDNN's convolutions choose an algorithm whose workspace fits). This
benchmark measures that ratio where the plan measures its points, and asks whether it carries over to the
caps of 16, 24 and 40 GiB cards.

For each workload of ``benchmarks/plan.py``: the plan's own runs (``make_plan``: the batch as written,
half of it, the batch again), then for both batches the smallest cap under which one step fits, found by
bisection on ``set_per_process_memory_fraction`` between 0.5x and 1.5x the run's allocated peak (7
halvings: to 1/128 of that range, under 0.8% of the peak). ``k`` is that cap over the allocated peak.
Four ways to predict the largest batch under each card's cap (the cap ``benchmarks/plan.py`` played the
card with, and the real largest batch it found by bisection under it, read from
``benchmarks/results/plan.json``; the JSON records both), without the plan's margin:

- ``allocated``: the plan's allocated line as it is;
- ``needed_line``: a line through the two smallest caps;
- ``k_proportional``: the allocated line times ``k`` of the batch as written;
- ``k_per_sample``: only the per-sample part scaled, by what the cap needed above the fixed part.

Writes ``benchmarks/results/plan_calibration.json`` ({device, versions, date, plan_json_date, cases:
[{workload, k_as_written, k_smaller, card_gib, real_batch, predictions: {way: {batch, error}}}]}). Run on
the GPU machine (about a minute on an H100)::

    python benchmarks/plan_calibration.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.plan import CARDS_GIB, RESULTS as PLAN_RESULTS, WORKLOADS, fits, make_plan, release, versions  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "plan_calibration.json"
HALVINGS = 7


def smallest_cap(workload: Any, batch: int, peak: int, total: int) -> float | None:
    """The smallest cap (bytes for PyTorch) under which one step at ``batch`` fits, within 1/2**HALVINGS
    of [0.5, 1.5] x ``peak``; ``None`` when even 1.5x does not fit."""

    def fits_under(cap: float) -> bool:
        torch.cuda.set_per_process_memory_fraction(min(cap / total, 1.0), 0)
        try:
            return fits(workload, batch)
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, 0)

    low, high = 0.5 * peak, 1.5 * peak
    if not fits_under(high):
        return None
    for _ in range(HALVINGS):
        middle = (low + high) / 2
        if fits_under(middle):
            high = middle
        else:
            low = middle
    return high


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(RESULTS), help="where to write the JSON")
    out = Path(parser.parse_args(argv).out)
    if not torch.cuda.is_available():
        print("no CUDA device: run on the GPU machine")
        return 2
    plan_results = json.loads(PLAN_RESULTS.read_text())
    real = {(c["workload"], c["card_gib"]): c for c in plan_results["cases"]}
    total = torch.cuda.get_device_properties(0).total_memory
    cases: list[dict[str, Any]] = []
    for name in WORKLOADS:
        release()
        workload = WORKLOADS[name]()
        plan, measured, _ = make_plan(workload, [], 0.0)
        runs = {r.label: r for r in measured.runs}
        big, small = runs["as written, again"], runs["smaller"]
        assert big.batch is not None and small.batch is not None and big.peak_bytes and small.peak_bytes
        found_big = smallest_cap(workload, big.batch, big.peak_bytes, total)
        found_small = smallest_cap(workload, small.batch, small.peak_bytes, total)
        line = plan.line
        if found_big is None or found_small is None or line is None:
            cases.append({"workload": name, "error": "did not fit under 1.5x its allocated peak"})
            continue
        need_big, need_small = found_big, found_small
        k_big, k_small = need_big / big.peak_bytes, need_small / small.peak_bytes
        k_above_fixed = (need_big - line.intercept_bytes) / (big.peak_bytes - line.intercept_bytes)
        needed_slope = (need_big - need_small) / (big.batch - small.batch)
        ways = {
            "allocated": lambda cap: (cap - line.intercept_bytes) / line.slope_bytes,
            "needed_line": lambda cap: (cap - (need_big - needed_slope * big.batch)) / needed_slope,
            "k_proportional": lambda cap: (cap / k_big - line.intercept_bytes) / line.slope_bytes,
            "k_per_sample": lambda cap: (cap - line.intercept_bytes) / (line.slope_bytes * k_above_fixed),
        }
        for gib in CARDS_GIB:
            card = real[(name, gib)]
            cap = card["cap_bytes_for_pytorch"]
            predictions = {}
            for way, predict in ways.items():
                batch = int(predict(cap))
                predictions[way] = {"batch": batch, "error": round(batch / card["real_batch"] - 1, 4)}
            cases.append({
                "workload": name, "batch_as_written": big.batch, "smaller_batch": small.batch,
                "allocated_peak_as_written_bytes": big.peak_bytes, "smallest_cap_as_written_bytes": int(need_big),
                "allocated_peak_smaller_bytes": small.peak_bytes, "smallest_cap_smaller_bytes": int(need_small),
                "k_as_written": round(k_big, 4), "k_smaller": round(k_small, 4),
                "card_gib": gib, "cap_bytes_for_pytorch": cap, "real_batch": card["real_batch"],
                "predictions": predictions,
            })
            print(name, gib, f"k {k_big:.3f}/{k_small:.3f}", {w: p["error"] for w, p in predictions.items()}, flush=True)
        del workload, plan, measured
        release()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "device": torch.cuda.get_device_name(0),
        "versions": versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "plan_json_date": plan_results.get("date"),
        "halvings": HALVINGS,
        "cases": cases,
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
