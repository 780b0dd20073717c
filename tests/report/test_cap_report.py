"""Reports under a per-process cap (``torch.cuda.set_per_process_memory_fraction``): shares and free
memory are measured against the cap and name it; the card has one total (PyTorch's), and where NVML's
differs one footnote says why."""

from __future__ import annotations

import pytest
from tests.fakes import FakeAllocator, FakeGpu, FakeMachine, FakeNvml

from jupyter_cudamem.advice import measurement_hints
from jupyter_cudamem.hardware import Hardware
from jupyter_cudamem.measure import Meter
from jupyter_cudamem.report.cell import CellReport
from jupyter_cudamem.units import format_bytes

# Nothing here runs a library whose version `make test-min` changes (tests/versioned.py).
pytestmark = pytest.mark.dependency_free

MiB = 1024**2
GiB = 1024**3


def _hardware(machine: FakeMachine) -> Hardware:
    return Hardware(allocator=FakeAllocator(machine), nvml=FakeNvml(machine), pid=machine.pid, pid_exists=lambda pid: True)


def _report(gpu: FakeGpu, allocate: int, limit_bytes: int | None = None) -> CellReport:
    machine = FakeMachine([gpu])
    meter = Meter(_hardware(machine))
    baseline = meter.start()
    machine.allocate(0, allocate)
    return CellReport(meter.stop(baseline, limit_bytes=limit_bytes), verbose=True)


def _row(report: CellReport, metric: str) -> str:
    return next(line for line in report.text().splitlines() if line.strip().startswith(metric))


@pytest.mark.parametrize("total_gib,cap_gib,peak_gib", [(80, 4, 1), (80, 4, 3.5), (24, 6, 2), (40, 10, 9.9)])
def test_shares_and_free_are_of_the_cap_and_name_it(total_gib, cap_gib, peak_gib):
    total, peak = int(total_gib * GiB), int(peak_gib * GiB)
    gpu = FakeGpu(total_bytes=total, fraction=cap_gib * GiB / total)
    report = _report(gpu, peak)
    device = report.devices[0]
    cap = int(total * gpu.fraction)
    assert device.cap_bytes == cap
    named = f"the {format_bytes(cap)} cap (set_per_process_memory_fraction)"
    assert f"{peak / cap:.1%} of {named}" in _row(report, "peak allocated")
    # Free at end is what PyTorch may still reserve under the cap, not the card's free memory.
    free = _row(report, "free at end")
    assert free.split()[3:5] == format_bytes(cap - peak).split() and f"under {named}" in free
    assert f"on a {format_bytes(total)} card" in free
    assert "of card" not in report.text() and named in report._repr_html_()
    near = [h for h in report.hints if h.startswith("peak is")]
    assert bool(near) == (peak / cap >= 0.85)
    if near:
        assert "per-process cap" in near[0] and f"{peak / cap:.0%}" in near[0]


def test_without_a_cap_shares_are_of_the_card():
    report = _report(FakeGpu(), 4 * GiB)
    assert report.devices[0].cap_bytes is None
    assert "5.0% of card" in _row(report, "peak allocated")
    assert _row(report, "free at end").endswith(f"of {format_bytes(80 * GiB)}")
    assert "cap" not in report.text()


def test_other_processes_bound_the_free_memory_under_a_cap():
    gpu = FakeGpu(fraction=0.5, other_process_bytes=70 * GiB)  # a 40 GiB cap, but only ~10 GiB left
    report = _report(gpu, 1 * GiB)
    assert report.devices[0].free_after_bytes == 80 * GiB - 70 * GiB - gpu.context_bytes - 1 * GiB


def test_limit_names_itself():
    gpu = FakeGpu(fraction=0.1)  # what %%cudamem --limit 8GiB sets for the cell
    report = _report(gpu, 1 * GiB, limit_bytes=8 * GiB)
    assert "(--limit)" in _row(report, "peak allocated") and "set_per_process_memory_fraction" not in report.text()


def test_one_total_for_the_card_and_one_footnote_on_nvml():
    gpu = FakeGpu(total_bytes=int(79.18 * GiB), driver_reserved_bytes=int(0.47 * GiB))
    report = _report(gpu, 2 * GiB)
    torch_total, nvml_total = format_bytes(gpu.total_bytes), format_bytes(gpu.total_bytes + gpu.driver_reserved_bytes)
    text = report.text()
    assert _row(report, "free at end").endswith(f"of {torch_total}¹")
    footnotes = [line for line in text.splitlines() if nvml_total in line]
    assert len(footnotes) == 1 and footnotes[0].strip().startswith("¹") and "driver" in footnotes[0]
    assert report._repr_html_().count(nvml_total) == 1
    assert report.devices[0].free_after_bytes == gpu.total_bytes - gpu.context_bytes - 2 * GiB
    agreeing = _report(FakeGpu(), 2 * GiB)
    assert "¹" not in agreeing.text() and "NVML says" not in agreeing.text()


def test_hints_use_the_cap():
    gpu = FakeGpu(fraction=0.05)  # 4 GiB of 80
    report = _report(gpu, int(3.8 * GiB))
    assert any(h.startswith("peak is 95% of the 4.00 GiB per-process cap") for h in measurement_hints(report.measurement))
