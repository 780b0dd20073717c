"""The monitor's state as text and HTML: pure functions, no widgets, no matplotlib.

The HTML panel (bars, numbers, an inline-SVG sparkline) is one string, so a view sends one message
per update; building it is cheap enough to run on every notification, unlike a matplotlib redraw.
"""

from __future__ import annotations

import html
import time
from collections.abc import Sequence

from ..units import format_bytes, format_seconds
from .state import DeviceState, MonitorState, Sample

DEFAULT_ALERT_FRACTION = 0.9
OWN_COLOR, OTHER_COLOR = "#1f77b4", "#aec7e8"
ALERT_OWN_COLOR, ALERT_OTHER_COLOR = "#d62728", "#ff9896"
SPARK_WIDTH, SPARK_HEIGHT = 160, 26
BAR_WIDTH = 320


def used_fraction(sample: Sample) -> float:
    return sample.used_bytes / sample.total_bytes if sample.total_bytes else 0.0


def is_alert(sample: Sample | None, alert_fraction: float) -> bool:
    """Whether the card is past the alert threshold: the bar turns red, so an OOM is seen coming."""
    return sample is not None and used_fraction(sample) >= alert_fraction


def _clock_time(time_s: float | None) -> str:
    return "" if time_s is None else time.strftime("%H:%M:%S", time.localtime(time_s))


def _status_words(state: MonitorState) -> str:
    if state.unavailable:
        return state.unavailable
    if state.running:
        words = f"every {format_seconds(state.interval_s)}"
    else:
        words = "stopped" + (f" ({state.stop_reason})" if state.stop_reason else "")
    if state.error:
        words += f"; error: {state.error} (retrying less often until it reads again)"
    return words


def device_text(row: DeviceState, alert_fraction: float = DEFAULT_ALERT_FRACTION) -> str:
    """One device in a few words: used/total, this kernel's share, utilisation, peak."""
    label = row.device.label
    sample = row.latest
    if sample is None:
        return f"{label}: {row.note or 'no reading yet'}"
    parts = [
        f"{label} {format_bytes(sample.used_bytes)} / {format_bytes(sample.total_bytes)} ({used_fraction(sample):.0%})"
    ]
    if is_alert(sample, alert_fraction):
        parts.append(f"over {alert_fraction:.0%} of the card")
    if sample.process_bytes is None:
        parts.append(row.note or "per-process memory not available here")
    else:
        parts.append(f"this kernel {format_bytes(sample.process_bytes)}")
    if sample.utilization_percent is not None:
        parts.append(f"util {sample.utilization_percent}%")
    if row.peak_used_bytes is not None:
        parts.append(f"peak {format_bytes(row.peak_used_bytes)}")
    return " · ".join(parts)


def text_line(state: MonitorState, alert_fraction: float = DEFAULT_ALERT_FRACTION) -> str:
    """The whole monitor as one line, for terminals and frontends without widgets."""
    if state.unavailable:
        return f"cudamem monitor: {state.unavailable}"
    rows = " | ".join(device_text(row, alert_fraction) for row in state.devices)
    if not rows:
        rows = "no reading yet" if state.running else "no GPU selected"
    return f"cudamem monitor ({_status_words(state)}): {rows}"


def _downsample_max(values: Sequence[int], points: int) -> list[int]:
    """At most ``points`` values, each the largest of its stretch, so a short spike stays visible."""
    if len(values) <= points:
        return list(values)
    step = len(values) / points
    return [max(values[int(i * step) : max(int((i + 1) * step), int(i * step) + 1)]) for i in range(points)]


def sparkline_svg(
    values: Sequence[int], width: int = SPARK_WIDTH, height: int = SPARK_HEIGHT, color: str = OWN_COLOR
) -> str:
    """An inline SVG polyline of ``values`` scaled from 0 to their maximum."""
    if not values:
        return f'<svg width="{width}" height="{height}"></svg>'
    shown = _downsample_max(values, max(width // 2, 2))
    top = max(max(shown), 1)
    if len(shown) == 1:
        shown = shown * 2
    step = (width - 2) / (len(shown) - 1)
    points = " ".join(
        f"{1 + i * step:.1f},{height - 1 - (value / top) * (height - 2):.1f}" for i, value in enumerate(shown)
    )
    title = html.escape(f"memory used, last {len(values)} samples; top of the scale {format_bytes(top)}")
    return (
        f'<svg width="{width}" height="{height}" style="vertical-align:middle">'
        f"<title>{title}</title>"
        f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{points}"/></svg>'
    )


def _bar_html(row: DeviceState, alert_fraction: float) -> str:
    sample = row.latest
    assert sample is not None
    total = sample.total_bytes or 1
    alert = is_alert(sample, alert_fraction)
    own_color, other_color = (ALERT_OWN_COLOR, ALERT_OTHER_COLOR) if alert else (OWN_COLOR, OTHER_COLOR)
    used_pct = min(sample.used_bytes / total, 1.0) * 100
    if sample.process_bytes is None:
        segments = [(0.0, used_pct, own_color, "used")]
    else:
        own_pct = min(sample.process_bytes / total * 100, used_pct)
        segments = [
            (0.0, own_pct, own_color, "this kernel"),
            (own_pct, used_pct - own_pct, other_color, "other processes"),
        ]
    parts = [
        f'<div style="position:absolute;left:{left:.2f}%;top:0;height:100%;width:{width:.2f}%;background:{color}" '
        f'title="{title}"></div>'
        for left, width, color, title in segments
        if width > 0
    ]
    parts.append(
        f'<div style="position:absolute;left:{alert_fraction * 100:.2f}%;top:0;height:100%;'
        f'border-left:1px dashed {ALERT_OWN_COLOR}" title="alert at {alert_fraction:.0%}"></div>'
    )
    if row.peak_used_bytes is not None:
        peak_pct = min(row.peak_used_bytes / total, 1.0) * 100
        parts.append(
            f'<div style="position:absolute;left:calc({peak_pct:.2f}% - 1px);top:0;height:100%;width:2px;'
            f'background:#222" title="peak {html.escape(format_bytes(row.peak_used_bytes))} at '
            f'{_clock_time(row.peak_time_s)}"></div>'
        )
    return (
        f'<div class="cudamem-bar" data-alert="{str(alert).lower()}" style="position:relative;'
        f'width:{BAR_WIDTH}px;height:14px;background:#e8e8e8;border-radius:3px;overflow:hidden">'
        + "".join(parts)
        + "</div>"
    )


def device_html(row: DeviceState, samples: Sequence[Sample], alert_fraction: float = DEFAULT_ALERT_FRACTION) -> str:
    name = html.escape(row.device.name)
    label = html.escape(row.device.label)
    sample = row.latest
    if sample is None:
        return f"<div><b>{label}</b> {name}: {html.escape(row.note or 'no reading yet')}</div>"
    alert = is_alert(sample, alert_fraction)
    color = ALERT_OWN_COLOR if alert else "inherit"
    numbers = (
        f'<span style="color:{color}">{format_bytes(sample.used_bytes)} / {format_bytes(sample.total_bytes)} '
        f"({used_fraction(sample):.0%})</span>"
    )
    details = []
    if sample.process_bytes is None:
        details.append(html.escape(row.note or "per-process memory not available here"))
    else:
        others = max(sample.used_bytes - sample.process_bytes, 0)
        details.append(f"this kernel {format_bytes(sample.process_bytes)}")
        details.append(f"other processes and driver {format_bytes(others)}")
    if sample.utilization_percent is not None:
        details.append(f"util {sample.utilization_percent}%")
    if row.peak_used_bytes is not None:
        details.append(f"peak {format_bytes(row.peak_used_bytes)} at {_clock_time(row.peak_time_s)}")
    spark_color = ALERT_OWN_COLOR if alert else OWN_COLOR
    spark = sparkline_svg([s.used_bytes for s in samples], color=spark_color)
    return (
        '<div style="margin:4px 0">'
        f"<div><b>{label}</b> {name} &mdash; {numbers}</div>"
        '<div style="display:flex;align-items:center;gap:8px">'
        f"{_bar_html(row, alert_fraction)}{spark}</div>"
        f'<div style="font-size:smaller;color:#555">{" &middot; ".join(details)}</div>'
        "</div>"
    )


def panel_html(
    state: MonitorState,
    histories: dict[int, list[Sample]],
    alert_fraction: float = DEFAULT_ALERT_FRACTION,
) -> str:
    """The widget's body: a status line, then one block per device."""
    status = html.escape(_status_words(state))
    status_color = ALERT_OWN_COLOR if (state.error or state.unavailable) else "#555"
    head = f'<div><b>GPU memory</b> <span style="color:{status_color}">{status}</span></div>'
    if state.unavailable:
        return head
    rows = [
        device_html(row, histories.get(row.key, []) if row.key is not None else [], alert_fraction)
        for row in state.devices
    ]
    if not rows:
        rows = ["<div>no reading yet</div>" if state.running else "<div>no GPU selected</div>"]
    return head + "".join(rows)
