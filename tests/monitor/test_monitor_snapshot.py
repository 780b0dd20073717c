"""The snapshot: recorded history as a matplotlib figure and PNG, and a text summary."""

from __future__ import annotations

from jupyter_cudamem.devices import Device
from jupyter_cudamem.monitor.poller import DeviceState, MonitorState, Sample
from jupyter_cudamem.monitor.snapshot import Snapshot
from tests.fakes import GiB

DEVICE = Device(torch_index=0, nvml_index=0, name="Fake H100", uuid="GPU-0", total_bytes=80 * GiB)


def history(count: int) -> list[Sample]:
    return [Sample(1000.0 + i, (i % 10) * GiB, 80 * GiB, (i % 10) * GiB // 2, 10) for i in range(count)]


def state(peak: int) -> MonitorState:
    row = DeviceState(DEVICE, history(1)[0], peak, 1009.0, None)
    return MonitorState(True, 1.0, 300.0, (row,), None, None)


def test_snapshot_plots_used_own_share_total_alert_and_peak():
    snapshot = Snapshot.of(state(9 * GiB), {0: history(30)}, alert_fraction=0.8)
    figure = snapshot.figure()
    (axes,) = figure.axes
    labels = [line.get_label() for line in axes.get_lines()]
    assert labels == ["used (all processes)", "this kernel", "total 80.0 GiB", "alert 80%", "peak"]
    used = axes.get_lines()[0]
    assert list(used.get_xdata())[:3] == [0.0, 1.0, 2.0]
    assert max(used.get_ydata()) == 9.0
    assert axes.get_lines()[3].get_ydata()[0] == 64.0
    png = snapshot.png()
    assert png.startswith(b"\x89PNG") and snapshot._repr_png_()[:4] == b"\x89PNG"


def test_snapshot_summary_is_one_line_of_text():
    text = repr(Snapshot.of(state(9 * GiB), {0: history(30)}))
    assert text == "cudamem monitor snapshot: cuda:0: 30 samples over 29.00 s, now 9.00 GiB, peak 9.00 GiB"
    assert repr(Snapshot((), 0.9)) == "cudamem monitor snapshot: nothing recorded"
    assert Snapshot((), 0.9).png().startswith(b"\x89PNG")
