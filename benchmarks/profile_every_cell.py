"""Where our per-cell time goes: cells through a real InteractiveShell, timed and profiled per mode.

``python3 benchmarks/profile_every_cell.py`` on the GPU machine reads the real hardware;
``--fake`` runs on any machine over the fakes of ``tests/fakes.py`` (whose reads cost about nothing),
so what is timed is our Python alone. Prints the median wall time per cell of each mode (bare,
IPython's ``%%time``, ``%%cudamem --quiet``, the every-cell mode) at each namespace size, and, with
``--profile MODE``, the functions that take the most time in that mode. A diagnostic for developers,
not a benchmark with goals (those are in overhead.py).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = ("bare", "time", "cudamem", "every_cell")


def _shell(fake: bool):  # noqa: ANN202
    import torch
    from IPython.core.interactiveshell import InteractiveShell

    from jupyter_cudamem import magics

    shell = InteractiveShell.instance()
    hardware = probe = None
    if fake:
        sys.path[:0] = [str(REPO)]
        from tests.fakes import FakeAllocator, FakeMachine, FakeNvml, torch_cpu_probe

        from jupyter_cudamem.hardware import Hardware

        machine = FakeMachine()
        hardware = Hardware(allocator=FakeAllocator(machine), nvml=FakeNvml(machine), pid=machine.pid,
                            pid_exists=lambda pid: True)
        machine.allocate(0, 1024)
        probe = torch_cpu_probe()
    else:
        torch.zeros(1, device="cuda")
    shell.user_ns["torch"] = torch
    return shell, hardware, probe


def _names(count: int, device: str) -> dict:
    sys.path[:0] = [str(REPO / "benchmarks")]
    from overhead import user_names

    return user_names(count, device)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fake", action="store_true", help="fake hardware from tests/fakes.py (any machine)")
    parser.add_argument("--cells", type=int, default=2000, help="cells per mode and size")
    parser.add_argument("--sizes", default="0,10000", help="user names in the namespace, comma separated")
    parser.add_argument("--profile", choices=MODES, default=None, help="print cProfile's top functions of this mode")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)

    from jupyter_cudamem import magics

    shell, hardware, probe = _shell(args.fake)
    device = "cpu" if args.fake else "cuda"
    cell = "x = 1"
    sources = {"bare": cell, "time": "%%time\n" + cell, "cudamem": "%%cudamem --quiet\n" + cell, "every_cell": cell}

    def run(mode: str, count: int) -> list[float]:
        source = sources[mode]
        samples = []
        for _ in range(count):
            started = time.perf_counter()
            shell.run_cell(source, store_history=False)
            samples.append(time.perf_counter() - started)
            if hardware is not None:
                hardware.allocator.calls.clear()
        return samples

    for size in (int(s) for s in args.sizes.split(",")):
        names = _names(size, device)
        shell.user_ns.update(names)
        medians = {}
        for mode in MODES:
            sink = io.StringIO()
            with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                if mode in ("cudamem", "every_cell"):
                    extension = magics.load(shell, hardware)
                    extension.magics[0].probe = probe
                if mode == "every_cell":
                    shell.run_line_magic("cudamem", "on")
                run(mode, 50)
                medians[mode] = statistics.median(run(mode, args.cells))
                if mode == args.profile:
                    profiler = cProfile.Profile()
                    profiler.enable()
                    run(mode, args.cells)
                    profiler.disable()
                if mode == "every_cell":
                    shell.run_line_magic("cudamem", "off")
                magics.unload(shell)
            if mode == args.profile:
                print(f"--- {mode}, {size} names: cProfile over {args.cells} cells (tottime) ---")
                pstats.Stats(profiler).sort_stats("tottime").print_stats(args.top)
        bare = medians["bare"]
        print(f"{size} names: bare {bare * 1e6:.1f} µs/cell; added: "
              + ", ".join(f"{mode} {(medians[mode] - bare) * 1e6:.1f}" for mode in MODES[1:]) + " µs")
        for name in names:
            shell.user_ns.pop(name, None)


if __name__ == "__main__":
    main()
