"""The cell report's "left behind" section, growth across runs and growth in a loop, as text and HTML."""

from __future__ import annotations

from jupyter_cudamem.attribution.left_records import Cause, Change
from jupyter_cudamem.attribution.holders import HolderKind, Origin
from jupyter_cudamem.attribution.left import LeftBehind, LeftHolder
from jupyter_cudamem.repeats import RunGrowth
from jupyter_cudamem.measure import Meter
from jupyter_cudamem.report.cell import CellReport, left_summary
from jupyter_cudamem.trace import LoopGrowth, TraceSummary
import pytest

# Nothing here runs a library whose version `make test-min` changes (tests/versioned.py).
pytestmark = pytest.mark.dependency_free

MiB = 1024**2


def _left() -> LeftBehind:
    losses = LeftHolder(
        name="losses",
        origin=Origin.VARIABLE,
        kind=HolderKind.LIST,
        nbytes=420 * MiB,
        cause=Cause.GRAPH,
        description="list of 40 tensors holding their autograd graphs, 419.00 MiB of saved activations",
        change=Change.GREW,
        advice=("keep numbers, not graphs: store loss.item()", "free it now: del losses"),
    )
    model = LeftHolder(
        name="model<b>",
        origin=Origin.VARIABLE,
        kind=HolderKind.MODULE,
        nbytes=10 * MiB,
        cause=Cause.MODEL,
        description="Linear: parameters 10.00 MiB",
        change=Change.NEW,
        advice=("a model's weights: expected",),
    )
    return LeftBehind(left_bytes=433 * MiB, holders=(losses, model), elapsed_s=0.012)


def _measurement(machine, hardware):
    meter = Meter(hardware)
    baseline = meter.start()
    machine.allocate(0, 433 * MiB)
    return meter.stop(baseline)


def test_text_names_holders_causes_advice_and_the_remainder(machine, hardware):
    report = CellReport(_measurement(machine, hardware), label="[7]", left=_left(), verbose=True)
    text = report.text()
    assert "left behind: 433.00 MiB still allocated after the cell; 430.00 MiB attributed (in 12 ms)" in text
    assert "leak   420.00 MiB  losses: list of 40 tensors holding their autograd graphs" in text
    assert "→ keep numbers, not graphs: store loss.item()" in text and "→ free it now: del losses" in text
    assert "result  10.00 MiB  model<b>: Linear: parameters 10.00 MiB" in text
    assert "3.00 MiB  not reachable from any name" in text
    # The section replaces the generic hint about memory left allocated.
    assert not any("left 433" in hint for hint in report.hints)
    assert any("left 433.00 MiB allocated" in hint for hint in CellReport(report.measurement).hints)


def test_html_escapes_names_and_marks_leaks(machine, hardware):
    html = CellReport(_measurement(machine, hardware), left=_left())._repr_html_()
    assert '<td class="leak">leak</td>' in html and '<td class="result">result</td>' in html
    assert "<code>model&lt;b&gt;</code>" in html and "model<b>" not in html
    assert "→ keep numbers, not graphs" in html


def test_growth_across_runs_and_in_a_loop_are_reported(machine, hardware):
    growth = RunGrowth(runs=3, per_run_bytes=420 * MiB, left_bytes=(420 * MiB,) * 3)
    loop = LoopGrowth(
        iterations=40,
        per_iteration_bytes=10 * MiB,
        kept_bytes=400 * MiB,
        kept_iterations=40,
        location="In[2] line 8 in forward",
        code="        x = self.fc(x)\n",
        called_from="In[5] line 4",
        called_from_code="    losses.append(model(x).sum())",
    )
    trace = TraceSummary(device_index=0, traced_peak_bytes=500 * MiB, sites=(), growth=loop)
    report = CellReport(_measurement(machine, hardware), growth=growth, traces=(trace,), verbose=True)
    text = report.text()
    assert "growing: each run of this cell leaves about +420.00 MiB more allocated (3 runs" in text
    assert (
        "grew in a loop: about +10.00 MiB per iteration over 40 iterations (400.00 MiB kept): "
        "In[2] line 8 in forward → x = self.fc(x), called from In[5] line 4 → losses.append(model(x).sum())"
    ) in text
    assert "growing: each run" in report._repr_html_() and "grew in a loop" in report._repr_html_()


def test_one_line_summary_for_the_every_cell_mode():
    assert left_summary(_left()) == (
        "left 433.00 MiB: leak losses 420.00 MiB (autograd graph); result model<b> 10.00 MiB (model); "
        "3.00 MiB not attributed"
    )
