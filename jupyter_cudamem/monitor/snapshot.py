"""The recorded history as a matplotlib figure, made on request (never per tick).

The figure is built with ``matplotlib.figure.Figure`` and the Agg canvas, not ``pyplot``: nothing
global changes, no GUI backend is needed, and the PNG shows in any frontend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..units import GiB
from ..report.plot import figure_png
from ..report.text import TextReport
from ..units import format_bytes, format_seconds
from .poller import MonitorState, Sample
from .render import DEFAULT_ALERT_FRACTION



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

    def figure(self) -> Any:
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
            axes.axhline(total, color="#555", linestyle="-", linewidth=0.8, label=f"total {total:.1f} GiB")
            axes.axhline(
                total * self.alert_fraction,
                color="#d62728",
                linestyle="--",
                linewidth=0.8,
                label=f"alert {self.alert_fraction:.0%}",
            )
            if device.peak_used_bytes is not None and device.peak_time_s is not None:
                axes.plot(
                    [device.peak_time_s - start], [device.peak_used_bytes / GiB], "v", color="#d62728", label="peak"
                )
            axes.set_title(f"{device.label} {device.name}", fontsize=10)
            axes.set_ylabel("GiB")
            axes.set_ylim(0, total * 1.05)
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

