"""The breakdown of a cell's peak (``breakdown.Breakdown``) as text, an HTML table and a stacked bar figure."""

from __future__ import annotations

import base64
import html
from typing import TYPE_CHECKING

from ..advice import CategoryAdvice, category_advice
from ..breakdown import CATEGORIES, OTHER_MODULE, Breakdown, Category, Phase
from ..collector import collector_paused
from ..units import GiB, KiB, MiB, format_bytes

if TYPE_CHECKING:
    from matplotlib.figure import Figure

FIGURE_SIZE_IN = (9.0, 3.0)
PNG_DPI = 100
# One colour per category, the same in every figure: model state in blues, what the batch makes in warm
# colours, the rest grey.
COLORS = {
    Category.PARAMETERS: "#1f4e79",
    Category.GRADIENTS: "#4a90c2",
    Category.OPTIMIZER_STATE: "#9cc3e4",
    Category.ACTIVATIONS: "#d95f02",
    Category.TEMPORARIES: "#fdb863",
    Category.OTHER: "#bdbdbd",
}
_UNITS = (("GiB", GiB), ("MiB", MiB), ("KiB", KiB), ("B", 1))


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.0%}" if whole else ""


def _where(breakdown: Breakdown) -> str:
    return "outside any model" if breakdown.phase is Phase.OUTSIDE else f"in the {breakdown.phase.value}"


def headline(breakdown: Breakdown) -> str:
    """``where the peak went: 5.20 GiB on cuda:0, reached in the backward: activations 61%, ...``"""
    parts = [
        f"{category.words} {_share(size, breakdown.peak_bytes)}"
        for category, size in sorted(breakdown.categories.items(), key=lambda item: -item[1])
        if size
    ]
    head = f"where the peak went: {format_bytes(breakdown.peak_bytes)} on {breakdown.device}, reached {_where(breakdown)}"
    return head + (": " + ", ".join(parts) if parts else "")


def _advice(breakdown: Breakdown) -> list[str]:
    advice: list[CategoryAdvice] = category_advice(breakdown.categories, breakdown.phase is Phase.OPTIMIZER_STEP)
    return [item.text() for item in advice]


def _notes(breakdown: Breakdown) -> list[str]:
    parts = breakdown.other_parts
    if parts is None:
        other = (
            "what no model made or owns (inputs, data, a loss computed outside a module), tensors older than the "
            "cell outside any model, and what the allocator gave out that is no tensor (cuBLAS's workspace, "
            "scratch inside one operation)"
        )
    else:
        other = (
            f"{format_bytes(parts.outside_models)} made by the cell outside any model (inputs, a loss computed by a "
            f"function), up to {format_bytes(parts.before_cell)} allocated before the cell outside any model "
            f"(data, earlier results, cuBLAS's workspace), {format_bytes(parts.unseen)} in no tensor seen (a "
            "workspace made now, scratch inside one operation)"
        )
    notes = [f"other: {other}; the tracker counted {format_bytes(breakdown.tracked_bytes)} of the peak"]
    if breakdown.scaled:
        notes.append(
            "the tracker counted more than the allocator's peak (its peak counter was not reset for this cell): "
            "its figures are scaled down to the peak"
        )
    return notes


def breakdown_lines(breakdown: Breakdown) -> list[str]:
    """The breakdown as indented text lines for the cell report."""
    peak = breakdown.peak_bytes
    lines = [f"  {headline(breakdown)}"]
    lines.append("    by category:")
    for category, size in breakdown.categories.items():
        lines.append(f"      {category.words:<16}{format_bytes(size):>12}  {_share(size, peak):>4}")
    lines.append("    by module:")
    for module, size in breakdown.modules.items():
        lines.append(f"      {module:<28}{format_bytes(size):>12}  {_share(size, peak):>4}")
    lines.extend(f"    advice: {text}" for text in _advice(breakdown))
    lines.extend(f"    note: {note}" for note in _notes(breakdown))
    return lines


def breakdown_figure(breakdown: Breakdown) -> Figure:
    """One horizontal bar for the whole peak and one per module, each stacked by category."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    modules = breakdown.modules
    rows = ["whole peak"] + list(modules)
    largest = max(breakdown.peak_bytes, 1)
    unit, scale = next(((name, size) for name, size in _UNITS if largest >= size), _UNITS[-1])
    figure = Figure(figsize=(FIGURE_SIZE_IN[0], max(FIGURE_SIZE_IN[1], 0.9 + 0.28 * len(rows))))
    figure.subplots_adjust(left=0.22, right=0.78, bottom=0.16, top=0.9)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    positions = list(range(len(rows)))[::-1]  # the whole peak on top
    for category in CATEGORIES:
        widths = [breakdown.categories[category]] + [breakdown.cells.get((m, category), 0) for m in modules]
        lefts = [0.0] * len(rows)
        for index, row in enumerate(rows):
            before = CATEGORIES[: CATEGORIES.index(category)]
            if index == 0:
                lefts[index] = sum(breakdown.categories[c] for c in before) / scale
            else:
                lefts[index] = sum(breakdown.cells.get((row, c), 0) for c in before) / scale
        axes.barh(positions, [w / scale for w in widths], left=lefts, color=COLORS[category], height=0.7)
    axes.set_yticks(positions, rows)
    axes.set_xlabel(unit)
    axes.set_title(
        f"{breakdown.device}: peak {format_bytes(breakdown.peak_bytes)}, reached {_where(breakdown)}",
        fontsize=10,
    )
    handles = [Patch(color=COLORS[c], label=c.words) for c in CATEGORIES]
    axes.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, fontsize="small")
    return figure


def breakdown_png(breakdown: Breakdown) -> bytes:
    import io

    with collector_paused():
        buffer = io.BytesIO()
        breakdown_figure(breakdown).savefig(buffer, format="png", dpi=PNG_DPI)
    return buffer.getvalue()


def breakdown_html(breakdown: Breakdown) -> str:
    """A table (module rows, category columns, totals) and the figure, for the cell report."""
    e = html.escape
    peak = breakdown.peak_bytes
    header = "".join(f"<th>{e(c.words)}</th>" for c in CATEGORIES) + "<th>total</th>"
    rows = []
    for module, total in list(breakdown.modules.items()):
        cells = "".join(f"<td>{e(format_bytes(size)) if size else ''}</td>" for size in breakdown.module_categories(module).values())
        name = e(module) if module == OTHER_MODULE else f"<code>{e(module)}</code>"
        rows.append(f"<tr><td>{name}</td>{cells}<td>{e(format_bytes(total))}</td></tr>")
    totals = "".join(
        f"<td><b>{e(format_bytes(size))}</b> <span class=\"note\">{_share(size, peak)}</span></td>"
        for size in breakdown.categories.values()
    )
    rows.append(f"<tr><td><b>peak</b></td>{totals}<td><b>{e(format_bytes(peak))}</b></td></tr>")
    advice = "".join(f'<div class="hint">advice: {e(text)}</div>' for text in _advice(breakdown))
    notes = "".join(f'<div class="note">{e(note)}</div>' for note in _notes(breakdown))
    image = base64.b64encode(breakdown_png(breakdown)).decode("ascii")
    return (
        f"<div><b>{e(headline(breakdown))}</b><table><tr><th>module</th>{header}</tr>{''.join(rows)}</table>"
        f'<img alt="breakdown of the peak" src="data:image/png;base64,{image}">{advice}{notes}</div>'
    )
