"""Matplotlib figures of the history, built without pyplot so no global figure state is touched."""

from __future__ import annotations

import io

from ..errors import CudaMemError
from ..history import CellRecord

GiB = 1024**3


def history_figure(records: list[CellRecord]):
    """Bars of each cell's peak allocated (GiB) per device, with what it left allocated as a line."""
    from matplotlib.figure import Figure

    points: dict[str, list[tuple[int, float, float]]] = {}
    labels: list[str] = []
    growing: list[tuple[int, float, str]] = []  # cells run again that left memory again
    for position, record in enumerate(records):
        labels.append(record.label)
        if record.growth is not None:
            top = max((d.peak_allocated_bytes or 0 for d in record.measurement.devices), default=0) / GiB
            growing.append((position, top, f"{record.growth.per_run_bytes / GiB:+.2f} GiB/run"))
        for device in record.measurement.devices:
            if device.peak_allocated_bytes is None:
                continue
            after = device.after.allocator
            points.setdefault(device.device.label, []).append(
                (position, device.peak_allocated_bytes / GiB, (after.allocated_bytes if after else 0) / GiB)
            )
    if not points:
        raise CudaMemError("nothing to plot: no measured cell used PyTorch's allocator yet")
    figure = Figure(figsize=(max(4.0, 0.45 * len(records) + 2), 3.2), layout="constrained")
    axes = figure.add_subplot()
    width = 0.8 / len(points)
    for offset, (device, values) in enumerate(sorted(points.items())):
        xs = [x + offset * width - 0.4 + width / 2 for x, _, _ in values]
        axes.bar(xs, [peak for _, peak, _ in values], width=width, label=f"{device} peak allocated")
        axes.plot(xs, [left for _, _, left in values], marker="o", linestyle="--", label=f"{device} allocated after")
    if growing:
        axes.scatter([x for x, _, _ in growing], [y for _, y, _ in growing], marker="^", color="crimson",
                     zorder=3, label="growing (left memory again)")
        for x, y, text in growing:
            axes.annotate(text, (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize="x-small",
                          color="crimson")
    axes.set_xticks(range(len(labels)), labels, rotation=45 if len(labels) > 12 else 0)
    axes.set_xlabel("cell")
    axes.set_ylabel("GiB")
    axes.set_title("GPU memory per cell")
    axes.legend(fontsize="small")
    return figure


def figure_png(figure, dpi: int = 100) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()
