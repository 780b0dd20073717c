"""Where our per-cell time goes: cells through a real InteractiveShell, timed and profiled per mode.

``python3 benchmarks/profile_every_cell.py`` on the GPU machine reads the real hardware;
``--fake`` runs on any machine over the fakes of ``tests/fakes.py`` (whose reads cost about nothing),
so what is timed is our Python alone. Prints the median wall time per cell of each mode (bare,
IPython's ``%%time``, ``%%cudamem --quiet``, the every-cell mode) at each namespace size, and, with
``--profile MODE``, the functions that take the most time in that mode; with ``--parts``, each part of
ours inside a running cell (median time per call, times its calls per cell: in a running cell a part costs
two to three times what ``timeit`` of it alone says, its code and data being cold); and the hardware reads
per cell of each mode (``overhead.calls_per_cell``). A diagnostic for developers, not a benchmark with goals
(those are in overhead.py).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
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


# The parts of a measured cell timed by --parts: (module, attribute path) of functions or methods of ours.
PARTS = (
    ("jupyter_cudamem.magics.cell_starts", "CellStarts._note_cell_start"),
    ("jupyter_cudamem.magics.every_cell", "EveryCell.pre_run_cell"),
    ("jupyter_cudamem.magics.every_cell", "EveryCell.post_run_cell"),
    ("jupyter_cudamem.magics.cudamem", "CudaMem.cudamem"),
    ("jupyter_cudamem.magics.measured_cell", "CellMeasurer.measure"),
    ("jupyter_cudamem.magics.measured_cell", "run_cell_body"),
    ("jupyter_cudamem.magics.left_attribution", "LeftAttribution.snapshot"),
    ("jupyter_cudamem.magics.left_attribution", "LeftAttribution._pre_run_cell"),
    ("jupyter_cudamem.magics.left_attribution", "LeftAttribution._post_run_cell"),
    ("jupyter_cudamem.magics.left_attribution", "LeftAttribution.left_behind"),
    ("jupyter_cudamem.magics.left_attribution", "ipython_reference_ids"),
    ("jupyter_cudamem.attribution.tracked", "TrackedNamespace.take"),
    ("jupyter_cudamem.measure", "Meter.start"),
    ("jupyter_cudamem.measure", "Meter.stop"),
    ("jupyter_cudamem.measure", "Meter._read_allocator"),
    ("jupyter_cudamem.measure", "Meter._read_nvml"),
    ("jupyter_cudamem.hardware", "Hardware.own_process_bytes"),
    ("jupyter_cudamem.magics.every_cell", "record"),
    ("jupyter_cudamem.magics.measured_cell", "record"),
    ("jupyter_cudamem.ipython_state", "release_flushed_underscores"),
)


@contextlib.contextmanager
def _parts_timed(samples: dict[str, list[float]]):
    """Each of ``PARTS`` timed (inclusive, seconds a call) into ``samples`` while inside; put back after."""
    import importlib

    patched = []
    for module_name, path in PARTS:
        owner = importlib.import_module(module_name)
        *classes, name = path.split(".")
        for class_name in classes:
            owner = getattr(owner, class_name)
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        calls = samples.setdefault(f"{module_name.rsplit('.', 1)[-1]}.{path}", [])

        def timed(*args, _original=original, _calls=calls, **kwargs):
            started = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                _calls.append(time.perf_counter() - started)

        setattr(owner, name, functools.wraps(original)(timed))
        patched.append((owner, name, original))
    try:
        yield
    finally:
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)


def _parts_of(shell, hardware, probe, every_cell: bool, run, mode: str, cells: int) -> dict[str, float]:
    """Seconds a cell of ``mode`` spends in each of ``PARTS`` (median a call, times calls a cell), the
    extension loaded inside ``_parts_timed`` so that the callbacks and magics it registers are the timed ones."""
    from jupyter_cudamem import magics

    parts: dict[str, list[float]] = {}
    with _parts_timed(parts):
        magics.load(shell, hardware).magics[0].probe = probe
        if every_cell:
            shell.run_line_magic("cudamem", "on")
        run(mode, 50)
        for calls in parts.values():
            calls.clear()
        run(mode, cells)
        if every_cell:
            shell.run_line_magic("cudamem", "off")
        magics.unload(shell)
    return {name: statistics.median(calls) * len(calls) / cells for name, calls in parts.items() if calls}


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
    parser.add_argument("--parts", action="store_true", help="time each part of ours inside a running cell")
    args = parser.parse_args(argv)

    from jupyter_cudamem import magics

    shell, hardware, probe = _shell(args.fake)
    device = "cpu" if args.fake else "cuda"
    shell.run_cell(f"a = torch.randn(256, 256, device='{device}')")  # what overhead.py's small_kernels cell reads
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
        per_cell: dict[str, dict[str, float]] = {}
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
                if args.parts and mode in ("cudamem", "every_cell"):
                    per_cell[mode] = _parts_of(shell, hardware, probe, mode == "every_cell", run, mode, args.cells)
            if mode == args.profile:
                print(f"--- {mode}, {size} names: cProfile over {args.cells} cells (tottime) ---")
                pstats.Stats(profiler).sort_stats("tottime").print_stats(args.top)
        bare = medians["bare"]
        print(f"{size} names: bare {bare * 1e6:.1f} µs/cell; added: "
              + ", ".join(f"{mode} {(medians[mode] - bare) * 1e6:.1f}" for mode in MODES[1:]) + " µs")
        for mode, found in per_cell.items():
            print(f"  {mode}, each part in a running cell (µs a cell, median a call x calls a cell):")
            for name, seconds in sorted(found.items(), key=lambda item: -item[1]):
                print(f"    {seconds * 1e6:8.2f}  {name}")
        for name in names:
            shell.user_ns.pop(name, None)
    import overhead

    if args.fake:
        overhead.FAKE.update(hardware=hardware, probe=probe)
    print("hardware reads per cell:", overhead.calls_per_cell(shell))


if __name__ == "__main__":
    main()
