"""Benchmark: the capacity plan on the workloads of the %oomfix sweep, which it was not built against.

``benchmarks/plan.py`` holds the four workloads the plan was developed on. This one asks the same question
of ``benchmarks/oomfix.py``'s workloads (its first sixteen, which ``results/plan_sweep.json`` holds:
torchvision and timm convnets, a BERT built from its config with AdamW, a GRU and an LSTM, an MLP that builds its own model and optimizer, ResNet-50 inference without
``no_grad``, a DataLoader loop, autocast; Llama-style, GPT-2, BERT-base and ViT fine-tunes and a GPT-2 850M
inference whose largest batch is 1 to 48), each in a plain namespace: its setup cells once, its batch set
where it lives (a knob cell or the cell itself). The batch as written is a quarter of the sweep's largest
batch under 6 GiB (``benchmarks/results/oomfix_sweep_2026-11-27_one_run.json``), so it fits comfortably. The plan is made
as ``%%cudamem_plan --calibrate`` makes it (``capacity.runs.measure_runs``, ``judge``, ``build_plan``),
for cards of 4, 6 and 8 GiB played by capping PyTorch at the card's memory less what this process holds
outside PyTorch; the calibration runs at the smallest, 4 GiB, card. Between runs every name the cell
bound is deleted (as the magic sets them aside). The real largest batch per card is found by bisection
with real runs of the cell under the cap (``bisect_batch.largest_fitting``, 25% steps from the
calibrated prediction).

Writes ``benchmarks/results/plan_sweep.json`` ({device, versions, date, cards_gib, cases: [{workload,
card_gib, default_batch, calibrated_batch, real_batch, default_error, calibrated_error}], workloads:
[{workload, batch_as_written, calibration, workspaces_optional, error}], summary}). Run on the GPU machine (a few minutes on an H100)::

    python benchmarks/plan_sweep.py
    python benchmarks/plan_sweep.py --workloads mlp_builds_own_model,gru_config_dict_from_earlier_cell
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks import bisect_batch  # noqa: E402
from benchmarks.oomfix import WORKLOADS, Workload, _is_oom, missing_module  # noqa: E402
from benchmarks.plan import smallest_card, versions  # noqa: E402
from jupyter_cudamem.capacity.cards import Card  # noqa: E402
from jupyter_cudamem.capacity.plan import CALIBRATED_MARGIN, DEFAULT_MARGIN, build_plan  # noqa: E402
from jupyter_cudamem.capacity.runs import Runner, judge, measure_runs  # noqa: E402
from jupyter_cudamem.hardware import default_hardware  # noqa: E402
from jupyter_cudamem.measure import Meter  # noqa: E402
from jupyter_cudamem.reruns.recording import Recorder  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "plan_sweep.json"
SWEEP = REPO / "benchmarks" / "results" / "oomfix_sweep_2026-11-27_one_run.json"
CARDS_GIB = (4, 6, 8)
GiB = 2**30


class Cell:
    """A workload's cell in a namespace: the batch set where it lives (``capacity.runs.Change``), and
    what the cell bound deleted before each run (``release``)."""

    def __init__(self, workload: Workload, batch: int) -> None:
        self.workload, self.original = workload, batch
        self.namespace: dict[str, Any] = {}
        for cell in workload.setup_cells("cuda"):
            exec(cell, self.namespace)
        self.keep = set(self.namespace)
        self.batch = batch

    def apply(self, batch: int) -> str:
        """Set the batch where it lives: the knob cell (an earlier cell: what it binds, a config or a
        DataLoader, is kept like the setup's), or the cell itself."""
        self.batch = batch
        if self.workload.knob:
            before = set(self.namespace)
            exec(self.workload.knob_at(batch, "cuda"), self.namespace)
            self.keep |= set(self.namespace) - before
        return self.workload.cell_at(batch, "cuda")

    def restore(self) -> None:
        self.apply(self.original)

    def release(self) -> None:
        for name in [n for n in self.namespace if n not in self.keep]:
            del self.namespace[name]
        gc.collect()
        torch.cuda.empty_cache()

    def run(self, source: str) -> None:
        exec(source, self.namespace)

    def fits(self, batch: int) -> bool:
        self.release()
        try:
            self.run(self.apply(batch))
            return True
        except Exception as error:
            if not _is_oom(error):
                raise
            return False
        finally:
            self.release()


def run_workload(workload: Workload, oracle: int, total: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    batch = max(2, oracle // 4)
    cell = Cell(workload, batch)
    hardware = default_hardware()
    runner = Runner(Meter(hardware, reset_peak=True), cell.run, _is_oom, release=cell.release,
                    recorder=Recorder(hardware.allocator))
    cards = [Card(f"{gib} GiB", gib) for gib in CARDS_GIB]

    started = time.perf_counter()
    cell.apply(batch)
    measured = measure_runs(runner, workload.cell_at(batch, "cuda"), batch, cell,
                            calibrate_at=lambda: smallest_card(cards, runner.measured),
                            cap_at=lambda usable: hardware.capped(usable, runner.measured.devices(), unread_fraction=None))
    judged = judge(measured, batch)
    found = measured.calibration
    summary: dict[str, Any] = {"workload": workload.name, "kind": workload.kind, "batch_as_written": batch,
                               "replay_recorded": judged.replay_runs is not None,
                               "workspaces_optional": judged.workspaces_optional,
                               "plan_s": round(time.perf_counter() - started, 2), "notes": list(judged.notes)
                               + list(measured.notes), "calibration": None}
    common = dict(non_pytorch_bytes=measured.non_pytorch_bytes, non_pytorch_how="measured", line=judged.line)
    default = build_plan(measured.runs, batch, "batch", cards, DEFAULT_MARGIN, reserved_line=judged.reserved_line,
                         replay_runs=judged.replay_runs, workspaces_optional=judged.workspaces_optional, **common)  # type: ignore[arg-type]
    calibrated = None
    if found is not None and judged.line is not None:
        summary["calibration"] = {"fitted_batch": found.fitted, "failed_batch": found.failed, "runs": found.runs,
                                  "ratio": found.ratio(judged.line), "card": found.card, "stopped": found.stopped}
        # As the magic makes it: the replay's runs too, which decide where the line is flat (``runs.judge``).
        calibrated = build_plan(measured.runs, batch, "batch", cards, CALIBRATED_MARGIN,
                                calibration=found, replay_runs=judged.replay_runs,
                                workspaces_optional=judged.workspaces_optional,
                                **common)  # type: ignore[arg-type]
    cell.release()
    cases = []
    for card in cards:
        gib = int(card.name.split()[0])
        cap = (card.total_bytes - measured.non_pytorch_bytes) / total
        guess_plan = calibrated or default
        guess = guess_plan.card(card.name).largest_batch or 1
        torch.cuda.set_per_process_memory_fraction(cap, 0)
        try:
            real, runs = bisect_batch.largest_fitting(
                cell.fits, max(guess, 1), up=lambda b: max(int(b * 1.25), b + 1),
                down=lambda b: max(int(b / 1.25), 1) if b > 1 else 0,
            )
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, 0)
        default_batch = default.card(card.name).largest_batch or 0
        calibrated_batch = None if calibrated is None else calibrated.card(card.name).largest_batch or 0
        case = {
            "workload": workload.name, "card_gib": gib, "default_batch": default_batch,
            "calibrated_batch": calibrated_batch, "real_batch": real, "real_search_runs": len(runs),
            "default_error": round(default_batch / real - 1, 4) if real else None,
            "calibrated_error": round(calibrated_batch / real - 1, 4) if real and calibrated_batch is not None else None,
        }
        cases.append(case)
        print(f"{workload.name[:34]:34s} {gib} GiB  default {default_batch:6d}  calibrated {calibrated_batch}  "
              f"real {real:6d}  ({case['default_error']}, {case['calibrated_error']})", flush=True)
    del cell
    gc.collect()
    torch.cuda.empty_cache()
    return cases, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="", help="comma-separated names (default: all)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/plan_sweep.py needs a CUDA device")
    torch.zeros(1, device="cuda")
    oracles = {name: info["oracle_batch"] for name, info in json.loads(SWEEP.read_text())["workloads"].items()
               if "oracle_batch" in info}
    chosen = [n for n in args.workloads.split(",") if n] or [w.name for w in WORKLOADS]
    total = torch.cuda.get_device_properties(0).total_memory
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0), "versions": versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cards_gib": list(CARDS_GIB), "margin": DEFAULT_MARGIN, "calibrated_margin": CALIBRATED_MARGIN,
        "cases": [], "workloads": [],
    }
    if args.out.exists() and args.workloads:  # a part: keep what the other workloads measured
        previous = json.loads(args.out.read_text())
        results["cases"] = [c for c in previous.get("cases", []) if c["workload"] not in chosen]
        results["workloads"] = [w for w in previous.get("workloads", []) if w["workload"] not in chosen]
    started = time.perf_counter()
    for workload in WORKLOADS:
        if workload.name not in chosen:
            continue
        missing = missing_module(workload)
        if missing or workload.name not in oracles:
            results["workloads"].append({"workload": workload.name, "error": f"skipped: {missing or 'no oracle'}"})
            continue
        try:
            cases, summary = run_workload(workload, oracles[workload.name], total)
        except Exception as error:  # record it; the others still run
            traceback.print_exc()
            cases, summary = [], {"workload": workload.name, "error": f"{type(error).__name__}: {error}"[:500]}
            torch.cuda.set_per_process_memory_fraction(1.0, 0)
            gc.collect()
            torch.cuda.empty_cache()
        results["cases"] += cases
        results["workloads"].append(summary)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    errors = [c["calibrated_error"] for c in results["cases"] if c["calibrated_error"] is not None]
    defaults = [c["default_error"] for c in results["cases"] if c["default_error"] is not None]
    results["summary"] = {
        "default_within_5_percent": sum(-0.05 <= e <= 0.05 for e in defaults),
        "default_above_by_more_than_margin": sum(e > DEFAULT_MARGIN for e in defaults),
        "calibrated_within_5_percent": sum(-0.05 <= e <= 0.05 for e in errors),
        "calibrated_above": sum(e > 0 for e in errors), "cases": len(results["cases"]),
    }
    results["wall_s"] = round(time.perf_counter() - started, 1)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results["summary"]), f"in {results['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
