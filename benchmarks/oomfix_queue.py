"""The %oomfix sweep as a queue of jobs over every GPU of one machine, within a time budget.

``python3 benchmarks/oomfix_queue.py --out DIR --seconds 520`` first measures each workload's steady oracle
(one job per workload, ``oomfix.py --oracles-only``), then runs one job per workload and start ratio
(``oomfix.py --workloads W --ratios R``), the longest first by ``oomfix.py``'s own estimate,
``--per-gpu`` jobs at once on each GPU (``CUDA_VISIBLE_DEVICES``), each capped as the sweep caps it. A job
still running when the budget ends is stopped; every job writes its cases as it goes, so what ran is kept.
``--oracles FILE`` skips the oracle jobs and reads FILE (oracles measured before). Merge the parts afterwards: ``oomfix.py --merge DIR/cases/*.json`` and ``--merge-oracles DIR/oracles/*.json``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import oomfix  # noqa: E402


def _gpus() -> list[str]:
    try:
        listed = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                                text=True, check=False).stdout.split()
    except FileNotFoundError:  # no driver here: one slot, to check the queue
        listed = []
    return listed or ["0"]


def run_queue(jobs: list[list[str]], gpus: list[str], per_gpu: int, deadline: float, logs: Path) -> list[str]:
    """Run ``jobs`` (argument lists for oomfix.py), ``per_gpu`` at a time on each GPU, until ``deadline``;
    return a line per job that did not end by itself."""
    slots = [gpu for gpu in gpus for _ in range(per_gpu)]
    running: dict[str, tuple[subprocess.Popen, str]] = {}
    pending = list(jobs)
    unfinished: list[str] = []
    script = str(Path(__file__).resolve().parent / "oomfix.py")
    while pending or running:
        for slot_id, gpu in enumerate(slots):
            key = f"{slot_id}"
            if key not in running and pending and time.monotonic() < deadline:
                args = pending.pop(0)
                name = "_".join(a.replace("/", "-").replace(",", "+") for a in args if not a.startswith("--"))[:120]
                env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu, "OMP_NUM_THREADS": "3"}
                with open(logs / f"{name}.log", "w") as log:
                    process = subprocess.Popen([sys.executable, script, *args], stdout=log, stderr=subprocess.STDOUT,
                                               env=env)
                running[key] = (process, name)
        for key, (process, name) in list(running.items()):
            if process.poll() is not None:
                del running[key]
            elif time.monotonic() >= deadline:
                process.kill()
                process.wait()
                unfinished.append(f"{name}: stopped at the budget's end")
                del running[key]
        if not pending and not running:
            break
        if time.monotonic() >= deadline and not running:
            unfinished.extend(f"{'_'.join(a for a in args if not a.startswith('--'))}: never started" for args in pending)
            break
        time.sleep(1)
    return unfinished


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seconds", type=float, default=520)
    parser.add_argument("--per-gpu", type=int, default=4)
    parser.add_argument("--gpus", default="", help="comma-separated indices (default: every GPU)")
    parser.add_argument("--workloads", default="", help="comma-separated (default: all)")
    parser.add_argument("--ratios", default=",".join(f"{r:g}" for r in oomfix.RATIOS))
    parser.add_argument("--finders", default=",".join(oomfix.FINDERS))
    parser.add_argument("--oracles", default=None,
                        help="an oracles file measured before (oomfix.py --merge-oracles): no oracle jobs")
    parser.add_argument("--traces", default=None, metavar="DIR", help="passed to each case job (oomfix.py --traces)")
    args = parser.parse_args()
    deadline = time.monotonic() + args.seconds
    out = Path(args.out)
    for sub in ("cases", "oracles", "logs"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    names = [n for n in args.workloads.split(",") if n] or list(oomfix.WORKLOAD_NAMES)
    ratios = [float(r) for r in args.ratios.split(",") if r]
    finders = tuple(f for f in args.finders.split(",") if f)
    workloads = [w for w in oomfix.WORKLOADS if w.name in names]
    oracles = oomfix.load_oracles(oomfix.ORACLES, oomfix.ORACLES)
    earlier = oomfix.json.loads(oomfix.SINGLE_RUN_RESULTS.read_text()) if oomfix.SINGLE_RUN_RESULTS.exists() else None
    cap = int(oomfix.CAP_GIB * 2**30)
    device = "NVIDIA H200"
    cost = {w.name: oomfix.estimate_seconds(w, ratios, finders, oracles, earlier, device, cap) for w in workloads}
    gpus = [g for g in args.gpus.split(",") if g] or _gpus()
    by_cost = sorted(workloads, key=lambda w: -cost[w.name]["oracle_s"])
    oracle_jobs = [["--oracles-only", "--workloads", w.name, "--oracles", str(out / "oracles" / f"{w.name}.json")]
                   for w in by_cost]
    started = time.monotonic()
    if args.oracles is None:
        unfinished = run_queue(oracle_jobs, gpus, args.per_gpu, deadline, out / "logs")
        print(f"oracles: {time.monotonic() - started:.0f} s; {unfinished or 'all ended'}", flush=True)
    per_case = {w.name: cost[w.name]["cases_s"] / max(len(ratios), 1) for w in workloads}
    case_jobs = sorted(([w.name, r] for w in workloads for r in ratios), key=lambda job: -per_case[job[0]])
    jobs = [["--workloads", name, "--ratios", f"{ratio:g}", "--finders", ",".join(finders),
             "--out", str(out / "cases" / f"{name}_x{ratio:g}.json"),
             "--oracles", args.oracles or str(out / "oracles" / f"{name}.json"),
             *(["--traces", args.traces] if args.traces else [])] for name, ratio in case_jobs]
    unfinished = run_queue(jobs, gpus, args.per_gpu, deadline, out / "logs")
    print(f"cases: {time.monotonic() - started:.0f} s in all; unfinished: {unfinished or 'none'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
