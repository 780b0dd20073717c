"""Diagnostic: one case of ``benchmarks/oomfix.py`` with PyTorch's allocation history recorded, to see why a
fixed cell's next run fails where ``%oomfix``'s last try fitted (GPU machine; no goals, no results file).

``--record next`` records the three next runs (with Python stacks) and keeps each of ``%oomfix``'s tries'
own recorded events; ``--record all`` records the whole case as a user would with their own recording on
(``%oomfix`` then reads that history: ``reruns.recording``). Writes ``OUT/<workload>_x<ratio>_<record>.pkl.gz``
(``tries``: batch, fitted, peak, allocated at start, steady, its ``RecordedRun``; ``next``: the next runs' history as
``(action, address, size, cell frames)``, and ``next_start`` the segments the first of them began with; ``search``: the
batch search as the driver asked it for the batch to report; ``record``: the case's record) and prints the case's outcome::

    python benchmarks/next_runs_history.py bert_base_seq256_adamw_in_cell 1.1 32 --record next --out /tmp/h
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import pickle
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import oomfix

CAP_BYTES = 6 * 2**30
MAX_ENTRIES = 2_000_000


def _cell_frames(entry: dict[str, Any]) -> list[tuple[str, int, str]]:
    frames = [f for f in entry.get("frames", []) if "ipython-input" in f.get("filename", "")
              or f.get("filename", "").startswith("<")]
    return [(f["filename"].rsplit("/", 1)[-1], f.get("line"), f.get("name")) for f in frames[:4]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload")
    parser.add_argument("ratio", type=float)
    parser.add_argument("oracle", type=int, help="the workload's steady oracle (results/oomfix_oracles.json)")
    parser.add_argument("--record", choices=("next", "all"), default="next")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    import torch

    torch.cuda.init()
    torch.cuda.set_per_process_memory_fraction(CAP_BYTES / torch.cuda.get_device_properties(0).total_memory, 0)
    torch.zeros(1, device="cuda")
    bench = oomfix.ShellBench("cuda")
    workload = next(w for w in oomfix.WORKLOADS if w.name == args.workload)
    kept: dict[str, Any] = {}
    run_line_magic, next_runs = bench.shell.run_line_magic, bench.next_runs

    def magic(name: str, line: str, *rest: Any, **options: Any) -> Any:
        result = run_line_magic(name, line, *rest, **options)
        if name == "oomfix":
            kept["tries"] = [(t.batch, t.fitted, t.peak_bytes, t.allocated_at_start_bytes, t.steady, t.recorded)
                             for t in result.tries]
        return result

    def recorded_next_runs(cell: str, runs: int = oomfix.NEXT_RUNS) -> dict[str, Any]:
        kept["next_start"] = start_segments(torch.cuda.memory._snapshot(), 0)  # where the first next run begins
        torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")
        try:
            return next_runs(cell, runs)
        finally:
            history = torch.cuda.memory._snapshot()["device_traces"][0]
            torch.cuda.memory._record_memory_history(enabled=None)
            kept["next"] = [(e["action"], e.get("addr"), e.get("size"), _cell_frames(e)) for e in history]

    from jupyter_cudamem.batchsearch import Tries
    from jupyter_cudamem.sources.torch_trace import start_segments

    answer = Tries.answer

    def kept_answer(search: Tries) -> int | None:
        kept["search"] = copy.copy(search)  # as it is asked for the batch to report
        kept["search"]._paired_runs = kept["search"]._paired_for = None  # caches of closures: not picklable
        return answer.fget(search)  # type: ignore[attr-defined]

    Tries.answer = property(kept_answer)  # type: ignore[assignment, method-assign]
    bench.shell.run_line_magic = magic
    if args.record == "next":
        bench.next_runs = recorded_next_runs
    else:
        torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")
    kept["record"] = oomfix.run_case(bench, workload, args.ratio, args.oracle, finders=("oomfix",))
    args.out.mkdir(parents=True, exist_ok=True)
    with gzip.open(args.out / f"{args.workload}_x{args.ratio}_{args.record}.pkl.gz", "wb") as file:
        pickle.dump(kept, file)
    record = kept["record"]
    print(args.workload, args.ratio, args.record, json.dumps({k: record.get(k) for k in
          ("found_batch", "next_runs_fit", "next_runs_fitted")}), [(t["batch"], t["fitted"]) for t in record["oomfix"]["tries"]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
