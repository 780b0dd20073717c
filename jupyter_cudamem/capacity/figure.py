"""The plan's figure: peak against batch, the measured points, each card's usable memory as a line.

Both axes are logarithmic: the measured batches are small beside the largest batch of an 80 GiB
card, and cards from 15 to 141 GiB must all be readable. Cards with the same usable memory share
one line and one label. Built without pyplot, so no global figure state is touched.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from ..units import GiB, MiB
from .prediction import PlanFigures, calibrated

if TYPE_CHECKING:
    from matplotlib.figure import Figure

FIGURE_SIZE_IN = (8.0, 4.5)
PNG_DPI = 100
LABEL_CLEARANCE = 1.12  # ratio of two card lines' heights below which their labels would overlap


def plan_figure(plan: PlanFigures) -> Figure:
    from matplotlib.figure import Figure

    figure = Figure(figsize=FIGURE_SIZE_IN, layout="constrained")
    axes = figure.add_subplot()
    cards = ([plan.this_card] if plan.this_card is not None else []) + list(plan.cards)
    groups: dict[int, list[str]] = {}
    planned_batch: dict[int, int | None] = {}  # the table's largest batch of the cards at each level
    for card in cards:
        name = f"this card ({card.name})" if card.this_card else card.name
        groups.setdefault(card.usable_bytes, []).append(name)
        planned_batch[card.usable_bytes] = card.largest_batch
    # the line each card's batch is planned on: the calibrated one, if any
    ratio = plan.calibration_ratio
    planned = plan.line if plan.line is None or ratio is None else calibrated(plan.line, ratio)
    points = [(r.batch, r.peak_bytes, r.autocast) for r in plan.runs
              if not r.oom and r.peak_bytes is not None and r.batch is not None]
    if plan.line is None:
        peak = (plan.fixed_peak_bytes or 0) / GiB
        axes.axhline(peak, color="black", linewidth=2, label=f"the cell's peak ({peak:.2f} GiB)")
        axes.set_xticks([])
        axes.set_xlabel("(no batch: planned as fixed-size)")
    else:
        line = plan.line
        largest_batches = [c.largest_batch for c in cards if c.largest_batch]
        measured = [batch for batch, _, _ in points]
        low = max(min(measured) / 2, 1)
        high = max(largest_batches + measured) * 1.3
        xs = [low * (high / low) ** (i / 200) for i in range(201)]
        if line.slope_bytes > 0:
            axes.plot(xs, [line.peak(x) / GiB for x in xs], color="black", linewidth=2,
                      label=f"peak = {line.intercept_bytes / GiB:.2f} GiB + {line.slope_bytes / MiB:.2f} MiB x batch")
        else:  # a phase no batch changes sets the peak where measured; the replay decides beyond (``runs.judge``)
            axes.plot([min(measured), max(measured)], [line.intercept_bytes / GiB] * 2, color="black", linewidth=2,
                      label=f"peak {line.intercept_bytes / GiB:.2f} GiB where measured (does not grow with the batch)")
        if planned is not None and planned is not line:
            axes.plot(xs, [planned.peak(x) / GiB for x in xs], color="#8b0000", linestyle="-.",
                      label=f"under a card's cap: {ratio:.3f} x the line (calibrated)")
        if plan.autocast_line is not None:
            axes.plot(xs, [plan.autocast_line.peak(x) / GiB for x in xs], color="black", linestyle="--",
                      label=f"under autocast ({plan.autocast_dtype or 'reduced precision'})")
        for batch, peak, autocast in points:
            axes.plot([batch], [peak / GiB], "s" if autocast else "o", color="#d62728", markersize=7)
        axes.plot([], [], "o", color="#d62728", label="measured")
        if plan.batch is not None:
            axes.axvline(plan.batch, color="grey", linestyle=":", label=f"batch as written ({plan.batch})")
        axes.set_xscale("log")
        axes.set_xlabel("batch size")
    axes.set_yscale("log")
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]
    slot, previous = 0, None
    # A card that leaves PyTorch nothing (what runs outside PyTorch fills it) has no level on a log scale;
    # the table says it does not fit.
    for i, (usable, names) in enumerate(sorted(item for item in groups.items() if item[0] > 0)):
        color = colors[i % len(colors)]
        level = usable / GiB
        axes.axhline(level, color=color, linewidth=1)
        # Labels of lines closer than ~12% would overlap at this height: move them along instead.
        slot = slot + 1 if previous is not None and level / previous < LABEL_CLEARANCE else 0
        previous = level
        axes.annotate(f"{', '.join(names)}: {level:.1f} GiB", xy=(0.01 + 0.3 * (slot % 3), level),
                      xycoords=("axes fraction", "data"), xytext=(0, 2), textcoords="offset points", fontsize=7,
                      color=color)
        largest = planned_batch.get(usable)
        if planned is not None and largest:
            # The batch the table gives this card (its margin and reserved line included), on the card's level.
            axes.plot([largest], [level], "o", color=color, markersize=5)
    axes.set_ylabel("GiB (log scale)")
    axes.set_title("Peak memory against batch, and what each card leaves PyTorch", fontsize=10)
    axes.legend(loc="lower right", fontsize=8)
    return figure


def plan_png(plan: PlanFigures) -> bytes:
    buffer = io.BytesIO()
    plan_figure(plan).savefig(buffer, format="png", dpi=PNG_DPI)
    return buffer.getvalue()
