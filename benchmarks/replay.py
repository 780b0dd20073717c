"""Benchmark: does the replay of PyTorch's caching allocator (``jupyter_cudamem/growth/replay.py``) tell
which runs fit under a cap, and predict the largest batch that fits?

Two steps:

1. ``--capture`` (GPU): each workload of ``benchmarks/oomfix.py`` in a fresh namespace, cache emptied,
   PyTorch capped at 6 GiB, at ``FRACTIONS`` x its largest fitting batch (the oracle of
   ``results/oomfix_sweep_2026-11-27_one_run.json``), with PyTorch's allocation history recorded (no stacks): the
   segments at the cell's start and every allocation, free, segment and refused request. Written
   gzipped to ``results/replay_traces/``, one file per part.
2. ``--validate`` (CPU, from those files): (a) each recorded run replayed as it was, under the cap:
   does the replay fit where the run fitted, and make the same segments? (b) from two runs (0.3x and
   0.6x, 0.1x and 0.3x, 0.6x and 0.95x), the largest batch whose replay fits, over the oracle (it fits
   at 1.0x, fails at 1.05x); beside it, the line through the two runs' allocated peaks aimed at the cap
   (what the search had without the replay). Raw results in ``results/replay.json``.

    python benchmarks/replay.py --capture --part 1/3 --out benchmarks/results/replay_traces/part1.json.gz
    python benchmarks/replay.py --validate benchmarks/results/replay_traces/*.json.gz
"""

from __future__ import annotations

import argparse
import datetime
import gc
import gzip
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import oomfix as sweep  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "replay.json"
FRACTIONS = (0.1, 0.3, 0.6, 0.95, 1.0, 1.05)
"""Small, middle and near-limit runs: the pairs a search has (a probe and a larger try), and the limit."""
PAIRS = ((0.3, 0.6), (0.1, 0.3), (0.6, 0.95))
KEEP = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "oom", "segment_map",
        "segment_unmap")


def capture(part: str, out: Path) -> None:
    import torch

    oracles = {k: v["oracle_batch"] for k, v in json.loads(sweep.RESULTS.read_text())["workloads"].items()}
    names = sweep.select_part([w.name for w in sweep.WORKLOADS if w.name in oracles], part)
    cap = int(sweep.CAP_GIB * 2**30)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(cap / total, 0)
    torch.zeros(1, device="cuda")
    bench = sweep.ShellBench("cuda")

    def segments() -> list[Any]:
        return [[s["address"], s["total_size"], s["segment_type"], s["stream"],
                 [[b["address"], b["size"], b["state"]] for b in s["blocks"]]]
                for s in torch.cuda.memory._snapshot()["segments"]]

    res: dict[str, Any] = {**sweep.environment("cuda", cap), "total_bytes": total, "fraction": cap / total,
                           "workloads": {}}
    res.pop("ratios", None)
    try:
        for name in names:
            workload = next(w for w in sweep.WORKLOADS if w.name == name)
            oracle = oracles[name]
            runs = res["workloads"][name] = {"oracle": oracle, "runs": []}
            for fraction in FRACTIONS:
                batch = max(int(fraction * oracle), 2)
                bench._setup(workload)
                knob = workload.knob_at(batch, "cuda")
                if knob:
                    bench.run(knob)
                gc.collect()
                torch.cuda.empty_cache()
                start_segments = segments()
                start = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                                         max_entries=2_000_000)
                error = bench.run(workload.cell_at(batch, "cuda"))
                snapshot = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(enabled=None)
                trace = [[e["action"], e.get("addr"), e.get("size"), e.get("stream")]
                         for e in snapshot["device_traces"][0] if e["action"] in KEEP]
                runs["runs"].append({"f": fraction, "batch": batch, "fitted": error is None, "start_alloc": start,
                                     "peak_alloc": torch.cuda.max_memory_allocated() - start,
                                     "peak_reserved": torch.cuda.max_memory_reserved(),
                                     "error": None if error is None else str(error)[:400],
                                     "start_segments": start_segments, "trace": trace})
                del error, snapshot
                bench.release()
                sweep.say(f"{name} {fraction} {batch} fitted={runs['runs'][-1]['fitted']} events={len(trace)}")
    finally:
        bench.close()
    out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(out, "wt") as handle:
        json.dump(res, handle)


def _start(raw: list[Any]) -> list[Any]:
    from jupyter_cudamem.growth import replay

    return [replay.StartSegment(address, kind == "small", tuple((size, state != "inactive") for _, size, state in blocks),
                                stream) for address, _total, kind, stream, blocks in raw]


def validate(paths: list[Path]) -> dict[str, Any]:
    from jupyter_cudamem.growth import fitting, replay
    from jupyter_cudamem.sources.torch_trace import events_from_trace

    result: dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                              "traces": [], "runs": [], "predictions": []}
    timings: list[float] = []
    for path in paths:
        data = json.load(gzip.open(path, "rt"))
        cap = int(data["fraction"] * data["total_bytes"])
        entry = {"file": path.name, "device": data.get("device"), "versions": data.get("versions")
                 or {"torch": data.get("torch")}, "date": data.get("date"), "cap_bytes": cap}
        if data.get("metadata_note"):
            entry["note"] = data["metadata_note"]
        result["traces"].append(entry)
        for name, workload in data["workloads"].items():
            runs = {run["f"]: run for run in workload["runs"]}
            events = {}
            for fraction, run in runs.items():
                start = _start(run["start_segments"])
                events[fraction] = (events_from_trace(run["trace"], start, failed=not run["fitted"]), start)
                started = time.perf_counter()
                replayed = replay.replay(events[fraction][0], start, cap)
                timings.append(time.perf_counter() - started)
                allocs = [e[2] for e in run["trace"] if e[0] == "segment_alloc"]
                frees = [e[2] for e in run["trace"] if e[0] == "segment_free"]
                result["runs"].append({
                    "workload": name, "fraction": fraction, "batch": run["batch"], "fitted": run["fitted"],
                    "replay_fits": replayed.fits,
                    "segment_allocs_same": Counter(replayed.segment_allocs) == Counter(allocs),
                    "segment_frees_same": Counter(replayed.segment_frees) == Counter(frees),
                    "allocated_peak_over_recorded": round((replayed.peak_allocated_bytes - run["start_alloc"])
                                                          / max(1, run["peak_alloc"]), 4),
                    "reserved_peak_over_recorded": round(replayed.peak_reserved_bytes / max(1, run["peak_reserved"]), 4),
                })
            oracle = workload["oracle"]
            for low, high in PAIRS:
                (first, _), (second, start) = events[low], events[high]
                paired = fitting.paired_fittings(first, runs[low]["batch"], second, runs[high]["batch"], start)
                predicted = None if paired is None else paired(cap, 0.0).largest()
                slope = (runs[high]["peak_alloc"] - runs[low]["peak_alloc"]) / (runs[high]["batch"] - runs[low]["batch"])
                line = runs[high]["batch"] + (cap - runs[high]["start_alloc"] - runs[high]["peak_alloc"]) / slope
                result["predictions"].append({
                    "workload": name, "pair": [low, high], "oracle_batch": oracle, "replay_batch": predicted,
                    "replay_over_oracle": None if predicted is None else round(predicted / oracle, 4),
                    "line_over_oracle": round(line / oracle, 4),
                    "paired_share": round(fitting.growth_lines(first, runs[low]["batch"], second, runs[high]["batch"]).share, 3),
                })
    agree = sum(r["fitted"] == r["replay_fits"] for r in result["runs"])
    ratios = {p["workload"]: p["replay_over_oracle"] for p in result["predictions"] if p["pair"] == [0.3, 0.6]}
    result["summary"] = {
        "runs_replayed_to_their_outcome": f"{agree} of {len(result['runs'])}",
        "segment_allocs_same": sum(r["segment_allocs_same"] for r in result["runs"]),
        "replay_over_oracle_from_0.3_and_0.6": ratios,
        "above_oracle": sum(1 for p in result["predictions"] if (p["replay_over_oracle"] or 0) > 1.0),
        "replay_ms_mean": round(1000 * sum(timings) / len(timings), 2),
        "replay_ms_max": round(1000 * max(timings), 2),
    }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capture", action="store_true", help="record traces on the GPU (with --part, --out)")
    parser.add_argument("--part", default="1/1")
    parser.add_argument("--out", default=None)
    parser.add_argument("--validate", nargs="+", metavar="TRACES", help="replay captured traces (CPU)")
    args = parser.parse_args(argv)
    if args.capture:
        if not args.out:
            parser.error("--capture needs --out FILE.json.gz")
        capture(args.part, Path(args.out))
        return 0
    if not args.validate:
        parser.error("give --capture (on the GPU) or --validate TRACES")
    result = validate([Path(p) for p in args.validate])
    out = Path(args.out) if args.out else RESULTS
    out.write_text(json.dumps(result, indent=1) + "\n")
    sweep.say(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
