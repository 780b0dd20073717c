"""The plan as plain text (terminal IPython, ``print``) and as HTML with its figure (notebooks)."""

from __future__ import annotations

import base64
import html

from ..growth.line import Line
from ..units import GiB, format_bytes
from .prediction import DEFAULT_MARGIN, CardPlan, PlanFigures, calibrated, replay_margin


def _gib(size: float) -> str:
    return f"{size / GiB:.1f} GiB"


def _per_sample(size: float) -> str:
    return f"{format_bytes(size)} per sample"


def _largest(card: CardPlan) -> str:
    return "-" if card.largest_batch is None else f"{card.largest_batch:,}"


def _card_name(card: CardPlan, plan: PlanFigures) -> str:
    return f"this card ({card.name})" if card.this_card else card.name


def _line_lines(plan: PlanFigures, line: Line) -> list[str]:
    """The knob, the line measured for it, how well other runs agree with it, and its slope under autocast."""
    lines = [f"Capacity plan for {plan.knob} = {plan.batch}"]
    if plan.batch_where:
        lines.append(f"  {plan.batch_where}")
    points = [r for r in plan.runs if r.label in ("smaller", "smaller still", "as written, again") and not r.oom]
    measured = ", ".join(f"{r.batch}: {format_bytes(r.peak_bytes)}" for r in points)
    if line.slope_bytes > 0:
        lines.append(
            f"  peak = {format_bytes(line.intercept_bytes)} + {format_bytes(line.slope_bytes)} x batch"
            f"   (PyTorch's allocated peak at batch {measured})"
        )
    else:
        lines.append(
            f"  peak = {format_bytes(line.intercept_bytes)} whatever the batch measured (PyTorch's allocated "
            f"peak at batch {measured}): a phase that does not depend on the batch"
        )
    for agreement in plan.agreements:
        lines.append(
            f"  {agreement.label} at batch {agreement.batch}: {format_bytes(agreement.measured_bytes)}, "
            f"{agreement.relative:+.1%} from the line"
        )
    if plan.autocast_line is not None and line.slope_bytes > 0:
        change = plan.autocast_line.slope_bytes / line.slope_bytes - 1
        lines.append(
            f"  under autocast ({plan.autocast_dtype or 'reduced precision'}): "
            f"{_per_sample(plan.autocast_line.slope_bytes)} ({change:+.0%})"
        )
    return lines


def summary_lines(plan: PlanFigures) -> list[str]:
    """Everything above the table: the line, how well it holds, the non-PyTorch part, the margin."""
    lines = []
    if plan.line is None:
        lines.append(
            f"Capacity plan for a cell with no batch: one run peaked at {format_bytes(plan.fixed_peak_bytes)} "
            "(planned as fixed-size)"
        )
    else:
        lines += _line_lines(plan, plan.line)
    lines.append(
        f"  outside PyTorch: {format_bytes(plan.non_pytorch_bytes)} (CUDA context and library workspaces), "
        f"{plan.non_pytorch_how}"
    )
    if plan.line is None:
        lines.append(
            f"  usable = card memory - outside PyTorch - {plan.margin:.0%} margin (the allocator's rounding, the driver's share)"
        )
        return lines
    if plan.replayed:  # never calibrated too: a calibration's ratio decides instead (``build_plan``)
        lines.append("  usable = card memory - outside PyTorch")
    else:
        lines.append(
            f"  usable = card memory - outside PyTorch; the largest batch leaves {plan.margin:.0%} of the room above "
            "the fixed part free (the allocator's rounding, the driver's share)"
        )
    found, ratio = plan.calibration, plan.calibration_ratio
    if found is not None and ratio is not None:
        where = ("this card" if found.card == "this card"
                 else f"a {found.card}'s memory (PyTorch capped here to play it)")
        bracket = (f"batch {found.fitted:,} fitted when the cell filled {where}"
                   + ("" if found.failed is None else f" and {found.failed:,} did not"))
        scaled = calibrated(plan.line, ratio)
        lines.append(
            f"  calibrated: {bracket}, so a card's cap takes {ratio:.3f} x the allocated line "
            f"(peak under a cap = {format_bytes(scaled.intercept_bytes)} + {format_bytes(scaled.slope_bytes)} x batch)"
        )
        return lines
    if plan.replayed:
        lines.append(
            "  largest batch: the two runs' recorded allocations replayed through PyTorch's caching allocator "
            "under each card's cap (its rounding and waste counted where they arise; workspaces a library gives "
            "back at once taken as "
            + ("ones it can do without, as it did in a run capped below its peak" if plan.workspaces_optional
               else "needed")
            + f"), each request {replay_margin(plan.margin):.0%} larger than its line; an estimate from two runs, "
            "which --calibrate checks on the smallest card of the plan"
        )
        return lines
    lines.append(
        "  an estimate from two runs: under a card's cap a cell can need more or less than its allocated "
        "peak (the allocator's cache and waste, workspaces libraries skip); --calibrate measures that on "
        "the smallest card of the plan"
    )
    if plan.reserved_line is not None:
        lines.append(
            f"  reserved by PyTorch's cache: {format_bytes(plan.reserved_line.intercept_bytes)} + "
            f"{format_bytes(plan.reserved_line.slope_bytes)} x batch; a card limits what is reserved, so the "
            "largest batch is the smaller of the two lines'"
            + (f" (below the reserved line, which holds the allocator's own share, {plan.margin - DEFAULT_MARGIN:.0%} "
               "of the room is left free)" if plan.margin > DEFAULT_MARGIN else "")
            + ("; the autocast column takes the same waste per byte" if plan.autocast_line is not None else "")
        )
    return lines


def card_rows(plan: PlanFigures) -> list[tuple[str, str, str, str, str, str]]:
    """(card, memory, usable, largest batch, under autocast, what to do) per card, this card first."""
    cards = ([plan.this_card] if plan.this_card is not None else []) + list(plan.cards)
    rows = []
    for card in cards:
        autocast = "-" if card.largest_autocast_batch is None else f"{card.largest_autocast_batch:,}"
        rows.append(
            (_card_name(card, plan), _gib(card.total_bytes), _gib(card.usable_bytes), _largest(card), autocast,
             card.advice(plan.batch, plan.trains))
        )
    return rows


def _headers(plan: PlanFigures) -> tuple[str, ...]:
    last = f"batch {plan.batch}" if plan.batch is not None else "the cell"
    return ("card", "memory", "usable", "largest batch", "autocast", last)


def plan_text(plan: PlanFigures) -> str:
    lines = summary_lines(plan)
    headers = _headers(plan)
    rows = card_rows(plan)
    keep = [i for i in range(len(headers)) if i != 4 or plan.autocast_line is not None]
    if plan.line is None:
        keep = [i for i in keep if i != 3]
    table = [tuple(headers[i] for i in keep)] + [tuple(row[i] for i in keep) for row in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(keep) - 1)]
    lines.append("")
    for row in table:
        lines.append("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1])
    lines += [f"note: {note}" for note in plan.notes]
    lines.append("(the figure shows in notebooks; plan.figure() draws it)")
    return "\n".join(lines)


def plan_html(plan: PlanFigures) -> str:
    e = html.escape
    summary = summary_lines(plan)
    parts = [f"<p><b>{e(summary[0])}</b></p>", "<ul>"]
    parts += [f"<li>{e(line.strip())}</li>" for line in summary[1:]]
    parts.append("</ul>")
    headers = _headers(plan)
    keep = [i for i in range(len(headers)) if i != 4 or plan.autocast_line is not None]
    if plan.line is None:
        keep = [i for i in keep if i != 3]
    parts.append('<table class="cudamem-plan"><thead><tr>')
    parts += [f"<th>{e(headers[i])}</th>" for i in keep]
    parts.append("</tr></thead><tbody>")
    for row in card_rows(plan):
        parts.append("<tr>" + "".join(f"<td>{e(row[i])}</td>" for i in keep) + "</tr>")
    parts.append("</tbody></table>")
    parts += [f"<p><i>{e(note)}</i></p>" for note in plan.notes]
    try:
        from .figure import plan_png

        png = base64.b64encode(plan_png(plan)).decode("ascii")
        parts.append(f'<img alt="peak against batch, with each card\'s usable memory" src="data:image/png;base64,{png}"/>')
    except ImportError:
        parts.append("<p><i>(install matplotlib for the figure)</i></p>")
    return "".join(parts)
