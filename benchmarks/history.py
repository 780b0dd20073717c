"""What ``%cudamem_history`` costs at 1,000, 10,000 and 100,000 measured cells: time, memory, output size.

Each (size, view) runs in a child process of its own, so one view's memory cannot hide in another's:
the child loads the extension over the test fakes (``tests/fakes.py``) in an ``InteractiveShell``, fills
the history with ``size`` distinct every-cell records (``tests/history_day.py``: builds, training steps,
evaluations, out-of-memory errors, cleanups, plain cells) and runs the magic as a user types it, under
``IPython.utils.capture.capture_output`` so every rich output (text/plain, text/html, image/png) is
formatted as a notebook frontend would receive it, and counted in bytes.

- time: the first call of a process (``cold``: it imports matplotlib for the plot) and then ``repeats``
  more calls (``warm``); ``--processes`` children per (size, view), 3 by default, give the cold calls'
  minimum and median and the warm calls' minimum and median over all of them.
- memory: the child's resident set before the first call and its peak over all the calls. The kernel's
  peak counter (VmHWM) is reset through ``/proc/self/clear_refs`` after the history is built, so the peak
  is the views' own, not the building's; where that reset is unavailable the peak is ``ru_maxrss`` and the
  result says so (``rss_method``).

Views: ``table`` (the default bounded table), ``table_all`` (``--all``, the whole table on request) and
``plot`` (``--plot``). It measures our code only, on the CPU: ``python benchmarks/history.py`` (about three
minutes on two cores) writes ``benchmarks/results/history.json``; ``--sizes 1000`` and ``--views plot`` run
a part. The load average before and after is recorded with the results: a busy machine slows every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "history.json"
SIZES = (1_000, 10_000, 100_000)
VIEWS = {"table": "", "table_all": "--all", "plot": "--plot"}
REPEATS = {"table": 7, "table_all": 3, "plot": 7}
GOAL_PLOT_S = 1.0


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's high-water mark of this process's RSS (Linux 4.0+); False where unsupported."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def child(size: int, view: str, repeats: int) -> dict[str, Any]:
    sys.path[:0] = [str(REPO)]
    from tests import history_day
    from tests.fakes import FakeAllocator, FakeMachine, FakeNvml
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    from jupyter_cudamem import magics
    from jupyter_cudamem.hardware import Hardware

    shell = InteractiveShell.instance()
    machine = FakeMachine()
    hardware = Hardware(FakeAllocator(machine), FakeNvml(machine), pid=machine.pid, pid_exists=lambda pid: True)
    extension = magics.load(shell, hardware)
    history = extension.magics[0].history
    history.max_records = size  # as %config CudaMem.history_size = size would
    started = time.perf_counter()
    for record in history_day.cells(size):
        history.add(record)
    build_s = time.perf_counter() - started
    assert len(history) == size

    rss_before_kib = _status_kib("VmRSS")
    reset = _reset_peak_rss()
    times: list[float] = []
    output_bytes: dict[str, int] = {}
    for _ in range(repeats + 1):
        started = time.perf_counter()
        with capture_output() as captured:
            shell.run_line_magic("cudamem_history", VIEWS[view])
        times.append(time.perf_counter() - started)
        output_bytes = {"stdout": len(captured.stdout.encode())}
        for output in captured.outputs:
            for mime, data in output.data.items():
                encoded = data.encode() if isinstance(data, str) else data
                output_bytes[mime] = output_bytes.get(mime, 0) + len(encoded)
    peak_kib = _status_kib("VmHWM") if reset else None
    method = "VmHWM after a clear_refs reset"
    if peak_kib is None:
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux; includes the building
        method = "ru_maxrss (includes building the history)"
    before_mib = (rss_before_kib or 0) / 1024
    return {
        "size": size,
        "view": view,
        "magic": f"%cudamem_history {VIEWS[view]}".strip(),
        "build_s": round(build_s, 3),
        "cold_s": round(times[0], 4),
        "warm_min_s": round(min(times[1:]), 4),
        "warm_median_s": round(statistics.median(times[1:]), 4),
        "warm_s": [round(t, 4) for t in times[1:]],
        "repeats": repeats,
        "output_bytes": output_bytes,
        "rss_before_mib": round(before_mib, 1),
        "peak_rss_mib": round(peak_kib / 1024, 1),
        "peak_rss_increase_mib": round(peak_kib / 1024 - before_mib, 1),
        "rss_method": method,
    }


def _versions() -> dict[str, str]:
    versions = {}
    for name in ("ipython", "matplotlib", "numpy", "traitlets", "ipywidgets", "torch"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False
        )
        versions["jupyter_cudamem_commit"] = commit.stdout.strip() or "unknown"
    except OSError:
        versions["jupyter_cudamem_commit"] = "unknown"
    return versions


def _machine() -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_gib = None
    try:
        memory_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3, 1)
    except (ValueError, OSError):
        pass
    return {"platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(), "memory_gib": memory_gib}


def _save_plots(directory: Path, sizes: list[int]) -> None:
    """The figure each size gives, to look at (the README shows the one at 10,000 cells)."""
    sys.path[:0] = [str(REPO)]
    from tests import history_day

    from jupyter_cudamem.report.plot import HistoryPlot

    directory.mkdir(parents=True, exist_ok=True)
    records = list(history_day.cells(max(sizes)))
    for size in sizes:
        print(HistoryPlot(records[:size]).save(directory / f"history-plot-{size}.png"), flush=True)


def _combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from the child processes of one (size, view): cold over processes, warm over all calls."""
    colds = [run["cold_s"] for run in runs]
    warms = [t for run in runs for t in run["warm_s"]]
    first = runs[0]
    return {
        "size": first["size"],
        "view": first["view"],
        "magic": first["magic"],
        "processes": len(runs),
        "build_s": [run["build_s"] for run in runs],
        "cold_min_s": min(colds),
        "cold_median_s": round(statistics.median(colds), 4),
        "cold_s": colds,
        "warm_min_s": min(warms),
        "warm_median_s": round(statistics.median(warms), 4),
        "warm_s": warms,
        "output_bytes": {mime: size for mime, size in first["output_bytes"].items() if mime != "stdout"},
        "stdout_bytes": first["output_bytes"].get("stdout", 0),
        "rss_before_mib": max(run["rss_before_mib"] for run in runs),
        "peak_rss_mib": max(run["peak_rss_mib"] for run in runs),
        "peak_rss_increase_mib": max(run["peak_rss_increase_mib"] for run in runs),
        "rss_method": first["rss_method"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="history sizes, comma-separated")
    parser.add_argument("--views", default=",".join(VIEWS), help=f"views among {', '.join(VIEWS)}")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--save-plots", type=Path, metavar="DIR", help="also write the plot at each size as a PNG")
    parser.add_argument("--processes", type=int, default=3, help="child processes per size and view (cold calls)")
    parser.add_argument("--child", nargs=3, metavar=("SIZE", "VIEW", "REPEATS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        size, view, repeats = args.child
        print(json.dumps(child(int(size), view, int(repeats))))
        return

    sizes = [int(size) for size in args.sizes.split(",")]
    views = [view for view in args.views.split(",") if view]
    unknown = [view for view in views if view not in VIEWS]
    if unknown:
        parser.error(f"unknown view {unknown[0]!r}: choose among {', '.join(VIEWS)}")
    results: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    for size in sizes:
        for view in views:
            print(f"history {size:,} cells, {view} ...", end=" ", flush=True)
            runs = []
            for _ in range(args.processes):
                command = [sys.executable, __file__, "--child", str(size), view, str(REPEATS[view])]
                done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, check=False)
                if done.returncode != 0:
                    failures.append({"size": size, "view": view, "error": done.stderr.strip().splitlines()[-1:]})
                    continue
                runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
            if not runs:
                print("failed:", failures[-1]["error"], flush=True)
                continue
            result = _combine(runs)
            results.append(result)
            print(
                f"cold min {result['cold_min_s']:.3f} s median {result['cold_median_s']:.3f} s, warm min "
                f"{result['warm_min_s']:.3f} s median {result['warm_median_s']:.3f} s, peak RSS "
                f"+{result['peak_rss_increase_mib']:.1f} MiB, output {sum(result['output_bytes'].values()):,} B",
                flush=True,
            )
    plots = [r for r in results if r["view"] == "plot"]
    tables = [r for r in results if r["view"] == "table"]
    goals = {
        "plot_under_1s_at_every_size (warm median)": all(r["warm_median_s"] < GOAL_PLOT_S for r in plots),
        "plot_under_1s_at_every_size (cold median, with the matplotlib import)": all(
            r["cold_median_s"] < GOAL_PLOT_S for r in plots
        ),
        "default_table_output_bytes_by_size": {r["size"]: r["output_bytes"] for r in tables},
    }
    report = {
        "benchmark": "history views (%cudamem_history) over the test fakes",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": "cpu (our code only; the history holds fake-hardware measurements)",
        "machine": _machine(),
        "load_average_before_after": [list(load_before), list(os.getloadavg())],
        "python": platform.python_version(),
        "versions": _versions(),
        "method": __doc__.split("\n\n", 1)[1].strip(),
        "results": results,
        "failures": failures,
        "goals": goals,
    }
    if args.save_plots:
        _save_plots(args.save_plots, sizes)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.output}", flush=True)


if __name__ == "__main__":
    main()
