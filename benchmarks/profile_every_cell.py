"""Where the every-cell mode's time goes on real hardware: cProfile of its two IPython callbacks.

``python3 benchmarks/profile_every_cell.py`` on the GPU machine; prints the median cost of one
pre_run_cell + post_run_cell pair and the functions that take the most time. A diagnostic for
developers, not a benchmark with goals (those are in overhead.py).
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import time
from types import SimpleNamespace


def main() -> None:
    import torch
    from IPython.core.interactiveshell import InteractiveShell

    from jupyter_cudamem import magics

    shell = InteractiveShell.instance()
    torch.zeros(1, device="cuda")
    extension = magics.load(shell)
    cudamem = extension.magics[0]
    info = SimpleNamespace(raw_cell="x = 1")
    result = SimpleNamespace(execution_count=1, error_in_exec=None, error_before_exec=None)

    def one_cell() -> None:
        cudamem.every_cell.pre_run_cell(info)
        cudamem.every_cell.post_run_cell(result)

    for _ in range(300):
        one_cell()
    samples = []
    for _ in range(3000):
        started = time.perf_counter()
        one_cell()
        samples.append(time.perf_counter() - started)
    print(f"pre_run_cell + post_run_cell: median {statistics.median(samples) * 1e6:.1f} µs over {len(samples)}")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(3000):
        one_cell()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
    magics.unload(shell)


if __name__ == "__main__":
    main()
