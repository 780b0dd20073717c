"""Added wall time per cell of %%cudamem and of the every-cell mode, beside today's per-cell peers.

Runs on the GPU machine: ``python3 benchmarks/overhead.py``. Each mode runs the same two kinds of cell
(a trivial one, one launching small kernels) in an in-process InteractiveShell; modes are interleaved
in rounds so drift hits all alike. Reports the median wall time per cell and the median added over
the bare cell. Writes benchmarks/results/overhead.json.

Peers, where they install: ipython-autotime (``%load_ext autotime``) and ipyexperiments' per-cell
logger (``IPyExperimentsPytorch``). A peer that fails to load is recorded with its error.
"""

from __future__ import annotations

import contextlib
import io
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

CELLS = {
    "trivial": "x = 1",
    "small_kernels": "y = (a @ a).relu_()\nz = y.sum()",
}
ROUNDS = 5
CELLS_PER_ROUND = 120  # 600 cells per mode and kind


def environment() -> dict:
    import IPython
    import torch

    info = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "ipython": IPython.__version__,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        import pynvml

        pynvml.nvmlInit()
        info["driver"] = pynvml.nvmlSystemGetDriverVersion()
        from importlib.metadata import version

        info["nvidia_ml_py"] = version("nvidia-ml-py")
    except Exception as error:  # recorded, not fatal: the benchmark still measures
        info["driver"] = f"unknown ({error})"
    return info


class Mode:
    """A way of running cells: how to switch it on and off, and how to wrap a cell."""

    def __init__(self, name, enable=None, disable=None, wrap=lambda cell: cell):
        self.name, self.enable, self.disable, self.wrap = name, enable, disable, wrap
        self.error: str | None = None


def main() -> None:
    from IPython.core.interactiveshell import InteractiveShell

    import torch

    shell = InteractiveShell.instance()
    shell.user_ns["torch"] = torch
    shell.run_cell("a = torch.randn(256, 256, device='cuda'); torch.cuda.synchronize()")

    def load_ours():
        shell.run_line_magic("load_ext", "jupyter_cudamem")

    def every_cell_on():
        load_ours()
        shell.run_line_magic("cudamem", "on")

    def every_cell_off():
        shell.run_line_magic("cudamem", "off")
        shell.run_line_magic("unload_ext", "jupyter_cudamem")

    def autotime_on():
        shell.run_line_magic("load_ext", "autotime")

    def autotime_off():
        shell.run_line_magic("unload_ext", "autotime")

    experiment = {}

    def ipyexperiments_on():
        from ipyexperiments import IPyExperimentsPytorch

        # Only its per-cell logger: the experiment part needs an ipykernel shell. Default options.
        experiment["exp"] = IPyExperimentsPytorch(exp_enable=False, cl_enable=True)

    def ipyexperiments_off():
        exp = experiment.pop("exp", None)
        if exp is not None:
            exp.finish()

    modes = [
        Mode("bare"),
        Mode("cudamem_cell_magic", enable=load_ours, disable=lambda: shell.run_line_magic("unload_ext", "jupyter_cudamem"),
             wrap=lambda cell: "%%cudamem --quiet\n" + cell),
        Mode("cudamem_every_cell", enable=every_cell_on, disable=every_cell_off),
        # Not a peer: IPython's own %%time, to show what running any cell magic costs.
        Mode("reference_ipython_time_cell_magic", wrap=lambda cell: "%%time\n" + cell),
        Mode("ipython_autotime", enable=autotime_on, disable=autotime_off),
        Mode("ipyexperiments", enable=ipyexperiments_on, disable=ipyexperiments_off),
    ]
    times: dict[str, dict[str, list[float]]] = {m.name: {k: [] for k in CELLS} for m in modes}
    sink = io.StringIO()
    for round_index in range(ROUNDS):
        for mode in modes:
            if mode.error:
                continue
            with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                try:
                    if mode.enable:
                        mode.enable()
                except Exception as error:
                    mode.error = f"{type(error).__name__}: {error}"
                    continue
                try:
                    for kind, cell in CELLS.items():
                        source = mode.wrap(cell)
                        for _ in range(CELLS_PER_ROUND):
                            started = time.perf_counter()
                            shell.run_cell(source, store_history=False)
                            times[mode.name][kind].append(time.perf_counter() - started)
                finally:
                    if mode.disable:
                        try:
                            mode.disable()
                        except Exception as error:
                            mode.error = f"disable failed: {type(error).__name__}: {error}"
            sink.seek(0)
            sink.truncate()

    results = {"environment": environment(), "rounds": ROUNDS, "cells_per_mode_and_kind": ROUNDS * CELLS_PER_ROUND,
               "cells": CELLS, "modes": {}}
    for mode in modes:
        entry: dict = {"error": mode.error}
        for kind in CELLS:
            samples = times[mode.name][kind]
            if not samples:
                continue
            median = statistics.median(samples)
            bare = statistics.median(times["bare"][kind])
            entry[kind] = {
                "n": len(samples),
                "median_ms": round(median * 1e3, 4),
                "p90_ms": round(sorted(samples)[int(0.9 * len(samples))] * 1e3, 4),
                "added_median_ms": round((median - bare) * 1e3, 4),
            }
        results["modes"][mode.name] = entry

    # The core alone, no IPython: one Meter start+stop (what each measured cell pays at least).
    from jupyter_cudamem.hardware import default_hardware
    from jupyter_cudamem.measure import Meter

    meter = Meter(default_hardware())
    samples = []
    for _ in range(2000):
        started = time.perf_counter()
        meter.stop(meter.start())
        samples.append(time.perf_counter() - started)
    results["meter_start_stop_median_ms"] = round(statistics.median(samples) * 1e3, 4)

    # What one measured cell cannot avoid: the hardware reads themselves (median of 2000 each, µs).
    import pynvml

    handle = pynvml.nvmlDeviceGetHandleByIndex(0)

    def cost(function) -> float:
        samples = []
        for _ in range(2000):
            started = time.perf_counter()
            function()
            samples.append(time.perf_counter() - started)
        return round(statistics.median(samples) * 1e6, 2)

    results["component_costs_us"] = {
        "torch.cuda.synchronize": cost(torch.cuda.synchronize),
        "torch.cuda.memory_stats_as_nested_dict": cost(lambda: torch.cuda.memory_stats_as_nested_dict(0)),
        "torch.cuda.reset_peak_memory_stats": cost(lambda: torch.cuda.reset_peak_memory_stats(0)),
        "nvmlDeviceGetMemoryInfo": cost(lambda: pynvml.nvmlDeviceGetMemoryInfo(handle)),
        "nvmlDeviceGetComputeRunningProcesses": cost(lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(handle)),
    }

    goals = {}
    for ours in ("cudamem_cell_magic", "cudamem_every_cell"):
        for kind in CELLS:
            added = results["modes"][ours].get(kind, {}).get("added_median_ms")
            peers = {
                name: results["modes"][name][kind]["added_median_ms"]
                for name in ("ipython_autotime", "ipyexperiments")
                if kind in results["modes"].get(name, {})
            }
            goals[f"{ours}/{kind}"] = {
                "added_median_ms": added,
                "under_1ms": added is not None and added < 1.0,
                "lower_than_peers": {name: added is not None and added < value for name, value in peers.items()},
            }
    results["goals"] = goals
    out = Path(__file__).parent / "results" / "overhead.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    json.dump(results, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
