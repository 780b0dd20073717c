"""benchmarks/plan.py's search for the real largest batch and its rule of thumb, on CPU with a stand-in
workload, so the GPU run's arithmetic is right the first time."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.benchmark_smoke

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_plan", REPO / "benchmarks" / "plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Limited:
    """A workload whose step runs out of memory above ``limit``."""

    batch = 64
    bytes_per_parameter = 16
    parameters = 1000

    def __init__(self, limit: int):
        self.limit = limit
        self.calls: list[int] = []

    def step(self, batch: int) -> None:
        self.calls.append(batch)
        if batch > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


@pytest.mark.parametrize("limit,guess", [(1000, 950), (1000, 1000), (1000, 1001), (1000, 40), (1000, 5000), (1, 7), (0, 5)])
def test_real_largest_finds_the_limit_from_any_guess(bench, limit, guess):
    workload = Limited(limit)
    found, tries = bench.real_largest(workload, guess)
    assert found == limit and tries == len(workload.calls)


def test_other_errors_are_not_taken_for_out_of_memory(bench):
    class Broken(Limited):
        def step(self, batch):
            raise ValueError("a bug in the workload")

    with pytest.raises(ValueError):
        bench.real_largest(Broken(10), 5)


def test_rule_of_thumb_scales_one_peak_after_bytes_per_parameter(bench):
    workload = Limited(0)
    static = 16 * 1000
    peak = static + 64 * 1000  # 1000 bytes per sample at batch 64
    assert bench.rule_of_thumb(workload, peak, static + 500_000) == 500
    assert bench.rule_of_thumb(workload, static // 2, 10**6) == 0


def test_namespace_batch_sets_and_restores(bench):
    namespace = {"batch": 64}
    change = bench.NamespaceBatch(namespace, 64)
    assert change.apply(32) == "step(batch)" and namespace["batch"] == 32
    change.restore()
    assert namespace["batch"] == 64
