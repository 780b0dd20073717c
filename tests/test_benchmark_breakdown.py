"""The breakdown benchmark's own arithmetic (its GPU run checks ours against it, so it must be right)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.benchmark_smoke

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("breakdown_benchmark", REPO / "benchmarks" / "breakdown.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_single_step_cuts_every_loop_to_one_iteration(bench):
    cell = "for step in range(3):\n    f()\nfor i in range(12):\n    g()\nx = list(range)\n"
    assert bench.single_step(cell) == "for step in range(1):\n    f()\nfor i in range(1):\n    g()\nx = list(range)\n"


def test_expected_bytes_counts_parameters_buffers_gradients_and_state_once(bench):
    torch = pytest.importorskip("torch")
    # Linear(10, 20): 200 + 20 floats = 880 bytes; BatchNorm1d(20): 40 floats of parameters (160 bytes) and
    # buffers of 20 + 20 floats and one int64 counter (168 bytes)
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.BatchNorm1d(20))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 10)).sum().backward()
    optimizer.step()
    namespace = {"model": model, "alias": model, "optimizer": optimizer, "_hidden": torch.nn.Linear(100, 100)}
    expected = bench.expected_bytes(namespace, "cpu")
    # momentum: one buffer per parameter, as large as it (SGD keeps no step counter)
    assert expected == {"parameters": 880 + 160 + 168, "gradients": 880 + 160, "optimizer_state": 880 + 160}
    assert bench.expected_bytes(namespace, "cuda") == {"parameters": 0, "gradients": 0, "optimizer_state": 0}
