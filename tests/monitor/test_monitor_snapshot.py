"""The snapshot: recorded history as a matplotlib figure and PNG, and a text summary."""

from __future__ import annotations

from jupyter_cudamem.hardware import Device
from jupyter_cudamem.monitor.poller import DeviceState, MonitorState, Sample
from jupyter_cudamem.monitor.snapshot import Snapshot
from tests.fakes import GiB

DEVICE = Device(torch_index=0, nvml_index=0, name="Fake H100", uuid="GPU-0", total_bytes=80 * GiB)


def history(count: int) -> list[Sample]:
    return [Sample(1000.0 + i, (i % 10) * GiB, 80 * GiB, (i % 10) * GiB // 2, 10) for i in range(count)]


def state(peak: int) -> MonitorState:
    row = DeviceState(DEVICE, history(1)[0], peak, 1009.0, None)
    return MonitorState(True, 1.0, 300.0, (row,), None, None)


def _samples(used_gib: list[float]) -> list[Sample]:
    return [Sample(1000.0 + i, int(u * GiB), 80 * GiB, int(u * GiB) // 2, 10) for i, u in enumerate(used_gib)]


def _snapshot(samples: list[Sample], alert_fraction: float = 0.8) -> Snapshot:
    peak = max(s.used_bytes for s in samples)
    row = DeviceState(DEVICE, samples[-1], peak, samples[[s.used_bytes for s in samples].index(peak)].time_s, None)
    return Snapshot.of(MonitorState(True, 1.0, 300.0, (row,), None, None), {0: samples}, alert_fraction)


def test_snapshot_plots_used_own_share_total_alert_and_peak():
    # A story that reaches most of the card: the whole card is the scale, total and alert are lines.
    snapshot = _snapshot(_samples([10, 30, 70, 50]))
    (axes,) = snapshot.figure().axes
    labels = [line.get_label() for line in axes.get_lines()]
    assert labels == ["used (all processes)", "this kernel", "total 80.0 GiB", "alert 80%", "peak"]
    used = axes.get_lines()[0]
    assert list(used.get_xdata())[:3] == [0.0, 1.0, 2.0]
    assert max(used.get_ydata()) == 70.0
    assert axes.get_lines()[3].get_ydata()[0] == 64.0
    assert axes.get_ylim()[1] >= 80.0 and not axes.texts
    png = snapshot.png()
    assert png.startswith(b"\x89PNG") and snapshot._repr_png_()[:4] == b"\x89PNG"


def test_the_scale_follows_the_data_and_the_total_stays_in_sight():
    # Under 5 GiB of an 80 GiB card: the data fills the plot, not its bottom 6%.
    for used in ([0.5, 2.0, 4.8, 1.0], [0.1, 0.2], [9.0] * 5, [39.0, 10.0]):
        snapshot = _snapshot(_samples(used), alert_fraction=0.9)
        (axes,) = snapshot.figure().axes
        top = axes.get_ylim()[1]
        assert max(used) / top >= 0.75, (used, top)  # the highest point sits in the top quarter
        assert max(used) <= top  # and is on the plot
        labels = [line.get_label() for line in axes.get_lines()]
        assert not any(label.startswith(("total", "alert")) for label in labels)
        [note] = [t.get_text() for t in axes.texts]
        assert "card total 80.0 GiB" in note and "alert 90% at 72.0 GiB" in note and "above this scale" in note


def test_the_alert_line_shows_when_the_data_nears_it():
    snapshot = _snapshot(_samples([20, 41]), alert_fraction=0.6)  # alert at 48 GiB, scale to 41 x 1.25
    (axes,) = snapshot.figure().axes
    labels = [line.get_label() for line in axes.get_lines()]
    assert "alert 60%" in labels and "total 80.0 GiB" in labels  # 41 GiB is over half the card: whole card


def test_snapshot_summary_is_one_line_of_text():
    text = repr(Snapshot.of(state(9 * GiB), {0: history(30)}))
    assert text == "cudamem monitor snapshot: cuda:0: 30 samples over 29.00 s, now 9.00 GiB, peak 9.00 GiB"
    assert repr(Snapshot((), 0.9)) == "cudamem monitor snapshot: nothing recorded"
    assert Snapshot((), 0.9).png().startswith(b"\x89PNG")
