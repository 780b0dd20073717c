"""The three lines ``%%cudamem``'s report shows first, for the common cells, and what ``--verbose`` (and the HTML's
details) adds (jupyter_cudamem/report/cell.py)."""

from __future__ import annotations

from dataclasses import replace

from tests.fakes import FakeAllocator, FakeMachine, FakeNvml, GiB, MiB

from jupyter_cudamem.attribution.left_records import Cause, Change
from jupyter_cudamem.attribution.holders import HolderKind, Origin
from jupyter_cudamem.attribution.left import LeftBehind, LeftHolder
from jupyter_cudamem.hardware import Hardware
from jupyter_cudamem.measure import Meter
from jupyter_cudamem.report.cell import CellReport
import pytest

# Nothing here runs a library whose version `make test-min` changes (tests/versioned.py).
pytestmark = pytest.mark.dependency_free

POINTER = ": --verbose, or %config CudaMem.verbose = True)"


def _measured(hardware, cell) -> object:
    meter = Meter(hardware)
    baseline = meter.start()
    cell()
    return replace(meter.stop(baseline), wall_s=0.25)  # a fixed time, so the title is known


def test_a_cell_with_a_peak_that_leaves_nothing(machine, hardware):
    # 4 GiB allocated and freed on a fresh 80 GiB card: PyTorch keeps the 4 GiB reserved, and the first
    # allocation made the 512 MiB CUDA context, so NVML's used rose 4.5 GiB and 75.5 GiB are free.
    report = CellReport(_measured(hardware, lambda: (machine.allocate(0, 4 * GiB), machine.free(0, 4 * GiB))),
                        label="[3]")
    assert report.text().splitlines() == [
        "cudamem [3] · 250 ms: cuda:0 peak 4.00 GiB (+4.00 GiB above start, 5.0% of the card), Δ allocated 0 B",
        "NVML: cuda:0 used +4.50 GiB (PyTorch reserved +4.00 GiB, outside PyTorch +512.00 MiB), 75.50 GiB free",
        "Left 512.00 MiB outside PyTorch (another library's memory, or CUDA's own), which NVML sees: PyTorch's "
        "allocated is back where it started",
        "(the figures per device and 2 hints" + POINTER,  # cached blocks, and the context outside PyTorch
    ]
    # The same once the context exists: nothing is left anywhere.
    again = CellReport(_measured(hardware, lambda: (machine.allocate(0, 4 * GiB), machine.free(0, 4 * GiB))),
                       label="[4]")
    assert again.lead()[2] == "Nothing left behind: allocated is back where it started"


def test_memory_another_library_keeps_is_the_finding_where_pytorch_left_nothing(machine, hardware):
    # CuPy's 1 GiB block, kept by a variable: PyTorch's allocator saw nothing, NVML sees the process hold 1 GiB more.
    machine.allocate(0, 0)  # the CUDA context, before the cell
    report = CellReport(_measured(hardware, lambda: setattr(machine.gpus[0], "outside_bytes", GiB)), label="[16]")
    assert report.lead()[1] == "NVML: cuda:0 used +1.00 GiB (PyTorch reserved 0 B, outside PyTorch +1.00 GiB), 78.50 GiB free"
    assert report.lead()[2].startswith("Left 1.00 GiB outside PyTorch")


def test_a_cell_that_freed_memory_says_it_freed_it(machine, hardware):
    # 456 MiB allocated before the cell and freed by it: allocated ends 456 MiB below where it started.
    machine.allocate(0, 456 * MiB)
    report = CellReport(_measured(hardware, lambda: machine.free(0, 456 * MiB)), label="[8]")
    first, _, third, _ = report.text().splitlines()
    assert first.endswith("Δ allocated -456.00 MiB")
    assert third == "Freed 456.00 MiB: allocated is below where it started"


def _leak(left_bytes: int) -> LeftBehind:
    losses = LeftHolder(
        name="losses", origin=Origin.VARIABLE, kind=HolderKind.LIST, nbytes=420 * MiB, cause=Cause.GRAPH,
        description="list of 40 tensors holding their autograd graphs", change=Change.GREW,
        advice=("keep numbers, not graphs: store loss.item()", "free it now: del losses"),
    )
    return LeftBehind(left_bytes=left_bytes, holders=(losses,), elapsed_s=0.01)


def test_a_cell_that_leaves_memory_behind_leads_with_the_leak_and_what_to_change(machine, hardware):
    report = CellReport(_measured(hardware, lambda: machine.allocate(0, 433 * MiB)), label="[4]", left=_leak(433 * MiB))
    first, second, third, pointer = report.text().splitlines()
    assert first.endswith("cuda:0 peak 433.00 MiB (+433.00 MiB above start, 0.5% of the card), Δ allocated +433.00 MiB")
    assert third == ("Left 433.00 MiB: leak losses 420.00 MiB (autograd graph); 13.00 MiB not attributed"
                     " → losses: keep numbers, not graphs: store loss.item()")
    assert pointer == "(the figures per device, who holds what it left and 1 hint" + POINTER
    # Below the threshold nobody is named: the third line says what was left and how to have it named.
    unnamed = CellReport(_measured(hardware, lambda: machine.allocate(0, 10 * MiB)))
    assert unnamed.text().splitlines()[2] == (
        "Left 10.00 MiB allocated; who holds it is named from %config CudaMem.attribute_threshold up")


def test_no_gpu_says_what_is_not_measured_in_three_lines_and_hides_nothing():
    machine = FakeMachine()
    hardware = Hardware(FakeAllocator(machine, status="PyTorch is not installed, so allocator figures are not measured"),
                        FakeNvml(machine, failure="NVML library (libnvidia-ml.so) not found"))
    report = CellReport(_measured(hardware, lambda: None), label="[5]")
    assert report.text().splitlines() == [
        "cudamem [5] · 250 ms: GPU memory not measured",
        "Not measured: PyTorch is not installed, so allocator figures are not measured; "
        "NVML library (libnvidia-ml.so) not found",
        "Nothing measured: the cell ran as a plain cell",
    ]
    assert "<details" not in report._repr_html_()


def test_an_out_of_memory_cell_points_to_oomfix(machine, hardware):
    meter = Meter(hardware)
    baseline = meter.start()
    machine.allocate(0, GiB)
    report = CellReport(meter.stop(baseline, error="OutOfMemoryError"))
    assert report.text().splitlines()[2] == "Ran out of GPU memory: run %oomfix in the next cell to diagnose and fix it"


def test_verbose_shows_every_figure_in_text_and_opens_the_html_details(machine, hardware):
    report = CellReport(_measured(hardware, lambda: machine.allocate(0, 433 * MiB)), label="[4]", left=_leak(433 * MiB))
    short, full = report.text(), replace(report, verbose=True).text()
    assert full.splitlines()[:3] == short.splitlines()[:3]
    for detail in ("peak allocated", "Δ reserved", "Δ NVML used", "free at end", "left behind: 433.00 MiB",
                   "→ free it now: del losses", "hint: 512.00 MiB more in use outside PyTorch"):
        assert detail in full and detail not in short
    page = report._repr_html_()
    assert page.index("Δ allocated +433.00 MiB") < page.index("<details><summary>") < page.index("<table>")
    assert "<details open>" in replace(report, verbose=True)._repr_html_()


def test_a_holder_larger_than_what_the_cell_left_is_explained_by_what_it_freed(machine, hardware):
    # images was 48 MiB before the cell and is rebound to a new 175 MiB tensor: the cell left 127 MiB net,
    # its holder made 175 MiB, so the cell freed at least the 48 MiB the old images held.
    machine.allocate(0, 48 * MiB)
    images = LeftHolder(name="images", origin=Origin.VARIABLE, kind=HolderKind.TENSOR, nbytes=175 * MiB,
                        cause=Cause.DATA, description="tensor", change=Change.REBOUND)
    left = LeftBehind(left_bytes=127 * MiB, holders=(images,), elapsed_s=0.01)
    report = CellReport(_measured(hardware, lambda: (machine.allocate(0, 175 * MiB), machine.free(0, 48 * MiB))),
                        label="[6]", left=left)
    lines = report.text().splitlines()
    assert lines[0].endswith("Δ allocated +127.00 MiB")
    assert lines[2] == ("Left 127.00 MiB: result images 175.00 MiB (data); the cell freed at least 48.00 MiB "
                        "allocated before it (the holders' figures are what it made)")
    assert "the cell freed at least 48.00 MiB allocated before it" in report._repr_html_()
