"""The recorded history as a matplotlib figure, made on request (never per tick).

The figure is built with ``matplotlib.figure.Figure`` and the Agg canvas, not ``pyplot``: nothing
global changes, no GUI backend is needed, and the PNG shows in any frontend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..units import GiB, MiB
from ..report.plot import figure_png
from ..report.text import TextReport
from ..units import format_bytes, format_seconds
from .state import MonitorState, Sample
from .render import DEFAULT_ALERT_FRACTION

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# The y-axis shows the whole card only when the data reaches this share of it; below, it zooms to the
# data, or a story of a few GiB on an 80 GiB card sits in the bottom few percent of the plot. Half:
# at or above it the data fills at least half of a whole-card axis, readable as it is, and the card's
# total (how close it came to running out) is the point of the plot.
WHOLE_CARD_FROM = 0.5
# Room above the highest point when zoomed, so the peak marker and the legend do not touch it.
HEADROOM = 1.25


def y_top(data_top_gib: float, total_gib: float) -> float:
    """The y-axis' upper end in GiB: the card's total (plus 5%) when the data reaches ``WHOLE_CARD_FROM`` of
    it, else the data's highest point plus ``HEADROOM`` (never above the whole-card scale, never zero)."""
    whole = total_gib * 1.05
    if total_gib <= 0 or data_top_gib >= WHOLE_CARD_FROM * total_gib:
        return whole if total_gib > 0 else max(data_top_gib * HEADROOM, 1.0)
    return min(max(data_top_gib * HEADROOM, MiB / GiB), whole)  # 1 MiB at least: an empty plot still has a scale


@dataclass(frozen=True)
class DeviceHistory:
    label: str
    name: str
    samples: tuple[Sample, ...]
    peak_used_bytes: int | None
    peak_time_s: float | None


@dataclass(frozen=True, repr=False)
class Snapshot(TextReport):
    """The monitor's history at one instant: ``figure()`` plots it, ``repr`` summarises it."""

    devices: tuple[DeviceHistory, ...]
    alert_fraction: float = DEFAULT_ALERT_FRACTION

    @classmethod
    def of(
        cls, state: MonitorState, histories: dict[int, list[Sample]], alert_fraction: float = DEFAULT_ALERT_FRACTION
    ) -> Snapshot:
        devices = []
        for row in state.devices:
            if row.key is None:
                continue
            devices.append(
                DeviceHistory(
                    label=row.device.label,
                    name=row.device.name,
                    samples=tuple(histories.get(row.key, [])),
                    peak_used_bytes=row.peak_used_bytes,
                    peak_time_s=row.peak_time_s,
                )
            )
        return cls(tuple(devices), alert_fraction)

    def figure(self) -> Figure:
        """A matplotlib ``Figure``: memory used, this kernel's share, total and alert line, per device."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        count = max(len(self.devices), 1)
        figure = Figure(figsize=(8, 2.6 * count), layout="constrained")
        FigureCanvasAgg(figure)
        axes_list = figure.subplots(count, 1, squeeze=False)[:, 0]
        if not self.devices:
            axes_list[0].text(0.5, 0.5, "nothing recorded", ha="center", va="center", transform=axes_list[0].transAxes)
            axes_list[0].set_axis_off()
            return figure
        for axes, device in zip(axes_list, self.devices):
            samples = device.samples
            if not samples:
                axes.text(
                    0.5, 0.5, f"{device.label}: nothing recorded", ha="center", va="center", transform=axes.transAxes
                )
                axes.set_axis_off()
                continue
            start = samples[0].time_s
            seconds = [s.time_s - start for s in samples]
            axes.plot(seconds, [s.used_bytes / GiB for s in samples], label="used (all processes)", color="#1f77b4")
            if any(s.process_bytes is not None for s in samples):
                axes.plot(
                    seconds,
                    [float("nan") if s.process_bytes is None else s.process_bytes / GiB for s in samples],
                    label="this kernel",
                    color="#2ca02c",
                )
            total = samples[-1].total_bytes / GiB
            alert = total * self.alert_fraction
            drawn = [s.used_bytes for s in samples] + [s.process_bytes or 0 for s in samples]
            drawn.append(device.peak_used_bytes or 0)
            top = y_top(max(drawn) / GiB, total)
            off_scale: list[str] = []
            if total <= top:
                axes.axhline(total, color="#555", linestyle="-", linewidth=0.8, label=f"total {total:.1f} GiB")
            else:
                off_scale.append(f"card total {total:.1f} GiB")
            if alert <= top:
                axes.axhline(
                    alert, color="#d62728", linestyle="--", linewidth=0.8, label=f"alert {self.alert_fraction:.0%}"
                )
            else:
                off_scale.append(f"alert {self.alert_fraction:.0%} at {alert:.1f} GiB")
            if device.peak_used_bytes is not None and device.peak_time_s is not None:
                axes.plot(
                    [device.peak_time_s - start], [device.peak_used_bytes / GiB], "v", color="#d62728", label="peak"
                )
            if off_scale:
                # The scale follows the data; the card's total stays in sight as a label at the top.
                axes.text(
                    0.99, 0.97, "↑ " + ", ".join(off_scale) + ": above this scale", ha="right", va="top",
                    fontsize=8, color="#555", transform=axes.transAxes,
                )
            axes.set_title(f"{device.label} {device.name}", fontsize=10)
            axes.set_ylabel("GiB")
            axes.set_ylim(0, top)
            axes.legend(loc="upper left", fontsize=8)
        axes_list[-1].set_xlabel("seconds since the first recorded sample")
        return figure

    def png(self) -> bytes:
        return figure_png(self.figure(), dpi=96)

    def _repr_png_(self) -> bytes:
        return self.png()

    def text(self) -> str:
        if not self.devices:
            return "cudamem monitor snapshot: nothing recorded"
        parts = []
        for device in self.devices:
            samples = device.samples
            if not samples:
                parts.append(f"{device.label}: nothing recorded")
                continue
            span = samples[-1].time_s - samples[0].time_s
            parts.append(
                f"{device.label}: {len(samples)} samples over {format_seconds(span)}, "
                f"now {format_bytes(samples[-1].used_bytes)}, peak {format_bytes(device.peak_used_bytes)}"
            )
        return "cudamem monitor snapshot: " + "; ".join(parts)

