"""Text and HTML renderings: the red alert, the sparkline, one-line text."""

from __future__ import annotations

import re

from jupyter_cudamem.hardware import Device
from jupyter_cudamem.monitor.poller import PROCESS_NOT_AVAILABLE, DeviceState, MonitorState, Sample
from jupyter_cudamem.monitor.render import (
    ALERT_OWN_COLOR,
    OWN_COLOR,
    is_alert,
    panel_html,
    sparkline_svg,
    text_line,
)
from tests.fakes import GiB
import pytest

# Nothing here runs a library whose version `make test-min` changes (tests/versioned.py).
pytestmark = pytest.mark.dependency_free

DEVICE = Device(torch_index=0, nvml_index=0, name="Fake <H100>", uuid="GPU-0", total_bytes=80 * GiB)


def state_with(used: int, process: int | None = None, running: bool = True, error: str | None = None) -> MonitorState:
    sample = Sample(time_s=1000.0, used_bytes=used, total_bytes=80 * GiB, process_bytes=process, utilization_percent=42)
    row = DeviceState(DEVICE, sample, used, 1000.0, PROCESS_NOT_AVAILABLE if process is None else None)
    return MonitorState(running=running, interval_s=1.0, history_s=300.0, devices=(row,), error=error, unavailable=None)


def bar_alert(html: str) -> str:
    match = re.search(r'class="cudamem-bar" data-alert="(\w+)"', html)
    assert match, html
    return match.group(1)


def test_the_bar_turns_red_past_the_threshold():
    below = panel_html(state_with(70 * GiB, 60 * GiB), {0: []})
    above = panel_html(state_with(73 * GiB, 60 * GiB), {0: []})  # 91% of 80 GiB
    assert bar_alert(below) == "false" and f"background:{ALERT_OWN_COLOR}" not in below
    assert bar_alert(above) == "true" and f"background:{ALERT_OWN_COLOR}" in above
    assert "over 90% of the card" in text_line(state_with(73 * GiB, 60 * GiB))
    assert "over" not in text_line(state_with(70 * GiB, 60 * GiB))


def test_the_threshold_is_configurable():
    state = state_with(40 * GiB, 30 * GiB)
    assert bar_alert(panel_html(state, {0: []}, alert_fraction=0.9)) == "false"
    assert bar_alert(panel_html(state, {0: []}, alert_fraction=0.5)) == "true"
    assert is_alert(state.devices[0].latest, 0.5) and not is_alert(state.devices[0].latest, 0.51)


def test_panel_shows_own_versus_other_processes_peak_and_escapes_names():
    html = panel_html(state_with(10 * GiB, 4 * GiB), {0: []})
    assert "this kernel 4.00 GiB" in html
    assert "other processes and driver 6.00 GiB" in html
    assert "util 42%" in html and "peak 10.00 GiB" in html
    assert "Fake &lt;H100&gt;" in html and "<H100>" not in html


def test_unmapped_process_memory_is_said_not_guessed():
    state = state_with(10 * GiB, None)
    assert PROCESS_NOT_AVAILABLE in panel_html(state, {0: []})
    line = text_line(state)
    assert PROCESS_NOT_AVAILABLE in line and "this kernel" not in line


def test_text_is_one_line_and_says_stopped_and_errors():
    line = text_line(state_with(10 * GiB, 4 * GiB, running=False, error="NVML failed: Unknown Error"))
    assert "\n" not in line
    assert line.startswith("cudamem monitor (stopped; error: NVML failed: Unknown Error")
    assert "cuda:0 10.00 GiB / 80.00 GiB (12%)" in line
    unavailable = MonitorState(False, 1.0, 300.0, (), None, "no GPU to monitor: no NVIDIA driver on this machine")
    assert text_line(unavailable) == "cudamem monitor: no GPU to monitor: no NVIDIA driver on this machine"
    assert "no GPU to monitor" in panel_html(unavailable, {})


def test_sparkline_is_inline_svg_with_bounded_points_that_keeps_spikes():
    values = [GiB] * 3000
    values[1234] = 9 * GiB  # one short spike in a long flat history
    svg = sparkline_svg(values, width=160, height=26, color=OWN_COLOR)
    assert svg.startswith("<svg") and svg.endswith("</svg>")
    points = re.search(r'points="([^"]+)"', svg).group(1).split()
    assert len(points) == 80
    ys = [float(p.split(",")[1]) for p in points]
    assert min(ys) == 1.0  # the spike reaches the top of the scale
    assert sum(1 for y in ys if y < 20) == 1


def test_sparkline_of_nothing_or_one_sample_is_still_valid_svg():
    assert sparkline_svg([]) == '<svg width="160" height="26"></svg>'
    assert len(re.search(r'points="([^"]+)"', sparkline_svg([5 * GiB])).group(1).split()) == 2
