"""The report shown under a measured cell: HTML in notebooks, plain text in terminals."""

from __future__ import annotations

from functools import cached_property

import html
from dataclasses import dataclass, field

from ..advice import measurement_hints
from ..attribution.left import DEFAULT_THRESHOLD_BYTES, LeftBehind, LeftHolder
from ..breakdown import Breakdown
from ..repeats import RunGrowth
from ..measure import DeviceMeasurement, Measurement
from ..trace import LoopGrowth, TraceSummary
from ..units import format_bytes, format_seconds
from .text import TextReport, disclosure_html, more_line

_STYLE = (
    "<style>.cudamem-report{font-family:var(--jp-code-font-family,monospace);font-size:12px;margin:2px 0}"
    ".cudamem-report table{border-collapse:collapse}.cudamem-report td,.cudamem-report th{padding:1px 8px;"
    "text-align:right;border:none}.cudamem-report td:first-child,.cudamem-report th:first-child{text-align:left}"
    ".cudamem-report .hint{color:#8a5300}.cudamem-report .note{color:#666}"
    ".cudamem-report .err{color:#b00020}.cudamem-report .leak{color:#b00020;font-weight:bold}"
    ".cudamem-report .result{color:#2e7d32}</style>"
)


def _percent(part: int | None, whole: int | None) -> str:
    if part is None or not whole:
        return ""
    return f"{part / whole:.1%}"


def cap_name(device: DeviceMeasurement, limit_bytes: int | None = None) -> str:
    """``the 4.00 GiB cap (set_per_process_memory_fraction)``: the cap a report measures against, named
    by what set it (``%%cudamem --limit`` or the user's own call); "" when no cap is set."""
    cap = device.cap_bytes
    if cap is None:
        return ""
    setter = "--limit" if limit_bytes else "set_per_process_memory_fraction"
    return f"the {format_bytes(cap)} cap ({setter})"


def total_footnote(device: DeviceMeasurement) -> str:
    """Why NVML's total differs from the one the report uses, or "" when they agree."""
    extra = device.nvml_extra_bytes
    if not extra:
        return ""
    assert device.after.nvml is not None
    return (
        f"the card's total is PyTorch's {format_bytes(device.total_bytes)} (what CUDA lets processes allocate); "
        f"NVML says {format_bytes(device.after.nvml.total_bytes)}, {format_bytes(abs(extra))} "
        f"{'more' if extra > 0 else 'less'}: memory the driver keeps for itself, which no process can use"
    )


def _rows(device: DeviceMeasurement, limit_bytes: int | None = None) -> list[tuple[str, str, str]]:
    """(metric, value, detail) for one device; metrics a source could not measure are left out. Shares
    are of the per-process cap where one is set (named), else of the card."""
    rows: list[tuple[str, str, str]] = []
    after = device.after.allocator
    cap = cap_name(device, limit_bytes)
    if device.peak_allocated_bytes is not None:
        share = _percent(device.peak_allocated_bytes, device.limit_bytes)
        detail = f"+{format_bytes(device.peak_above_start_bytes)} above start, {share} of {cap or 'card'}"
        if not device.peak_is_block_peak:
            detail += " (since last reset)"
        rows.append(("peak allocated", format_bytes(device.peak_allocated_bytes), detail))
    if after is not None:
        rows.append(("Δ allocated", format_bytes(device.allocated_delta_bytes, signed=True), f"now {format_bytes(after.allocated_bytes)}"))
        rows.append(("Δ reserved", format_bytes(device.reserved_delta_bytes, signed=True), f"now {format_bytes(after.reserved_bytes)}"))
    if device.nvml_used_delta_bytes is not None:
        outside = device.outside_pytorch_delta_bytes
        detail = "" if outside is None else f"outside PyTorch {format_bytes(outside, signed=True)}"
        if device.process_delta_bytes is None and device.before.nvml is not None:
            detail += ("; " if detail else "") + "whole device (per-process memory not available here)"
        rows.append(("Δ NVML used", format_bytes(device.nvml_used_delta_bytes, signed=True), detail))
    if device.free_after_bytes is not None:
        total = format_bytes(device.total_bytes) + ("¹" if device.nvml_extra_bytes else "")
        where = f"under {cap}, on a {total} card" if cap else f"of {total}"
        rows.append(("free at end", format_bytes(device.free_after_bytes), where))
    return rows


_REMAINDER = (
    "not reachable from any name: PyTorch's own caches (cuBLAS's workspace on a process's first matmul or "
    "first backward), tensors only C++ code keeps, or objects the walk does not enter"
)


_OUTSIDE_NOTED_BYTES = DEFAULT_THRESHOLD_BYTES
"""What a cell leaves outside PyTorch's pools (CuPy's or JAX's pool, a CUDA context) that the finding names:
as much as PyTorch memory left must be for the report to name its holders; less (a library's handles, a
few MiB of workspace) stays in the NVML line."""

_FREED = "the cell freed at least {} allocated before it (the holders' figures are what it made)"


def _holder_head(holder: LeftHolder) -> tuple[str, str]:
    """``(verdict, text)`` for one holder: ``leak``/``result`` and ``losses: list of 40 tensors ...``."""
    verdict = "leak" if holder.leak else "result"
    likely = ""
    if holder.likely:
        likely = " (likely: not in the fingerprint the cell started with, counted to explain what it left)"
    where = f" via {holder.where}" if holder.where and holder.where not in holder.description else ""
    also = f"; also reached from {', '.join(holder.also)}" if holder.also else ""
    return verdict, f"{holder.name}: {holder.description}{where}{also}{likely}"


def left_lines(left: LeftBehind) -> list[str]:
    """The report's "left behind" section as text lines (indented for the cell report)."""
    lines = [
        f"  left behind: {format_bytes(left.left_bytes)} still allocated after the cell; "
        f"{format_bytes(min(left.attributed_bytes, left.left_bytes))} attributed "
        f"(in {left.elapsed_s * 1000:.0f} ms{', walk stopped at its bound' if left.truncated else ''})"
    ]
    for holder in left.holders:
        verdict, text = _holder_head(holder)
        lines.append(f"    {verdict:<6}{format_bytes(holder.nbytes):>11}  {text}")
        lines.extend(f"    {'':<6}{'':>11}    → {advice}" for advice in holder.advice)
    if left.smaller_bytes:
        lines.append(f"    {'':<6}{format_bytes(left.smaller_bytes):>11}  {left.smaller_count} smaller holders")
    if left.remainder_bytes:
        lines.append(f"    {'':<6}{format_bytes(left.remainder_bytes):>11}  {_REMAINDER}")
    if left.freed_bytes:
        lines.append(f"    {'':<6}{'':>11}  {_FREED.format(format_bytes(left.freed_bytes))}")
    return lines


def left_summary(left: LeftBehind) -> str:
    """One line for the every-cell mode: ``left 433 MiB: leak losses 420 MiB (autograd graph); ...``."""
    parts = [
        f"{'leak' if h.leak else 'result'} {h.name} {format_bytes(h.nbytes)} ({h.cause})" for h in left.holders[:3]
    ]
    if left.remainder_bytes:
        parts.append(f"{format_bytes(left.remainder_bytes)} not attributed")
    if left.freed_bytes:
        parts.append(_FREED.format(format_bytes(left.freed_bytes)))
    return f"left {format_bytes(left.left_bytes)}: " + "; ".join(parts or ["nothing attributed"])


def left_finding(left: LeftBehind) -> str:
    """``left_summary`` and, where a holder is a leak, what to change for the largest one: the line the
    report leads with and the every-cell mode prints."""
    leak = next(iter(left.leaks), None)
    advice = f" → {leak.name}: {leak.advice[0]}" if leak is not None and leak.advice else ""
    return left_summary(left) + advice


def _left_html(left: LeftBehind) -> str:
    e = html.escape
    rows = []
    for holder in left.holders:
        verdict, text = _holder_head(holder)
        advice = "".join(f"<br>→ {e(item)}" for item in holder.advice)
        rows.append(
            f'<tr><td class="{verdict}">{verdict}</td><td>{e(format_bytes(holder.nbytes))}</td>'
            f'<td style="text-align:left"><code>{e(holder.name)}</code>{e(text[len(holder.name):])}'
            f'<span class="hint">{advice}</span></td></tr>'
        )
    if left.smaller_bytes:
        rows.append(
            f"<tr><td></td><td>{e(format_bytes(left.smaller_bytes))}</td>"
            f'<td style="text-align:left">{left.smaller_count} smaller holders</td></tr>'
        )
    if left.remainder_bytes:
        rows.append(
            f"<tr><td></td><td>{e(format_bytes(left.remainder_bytes))}</td>"
            f'<td style="text-align:left" class="note">{e(_REMAINDER)}</td></tr>'
        )
    if left.freed_bytes:
        rows.append(f'<tr><td></td><td></td><td style="text-align:left" class="note">'
                    f"{e(_FREED.format(format_bytes(left.freed_bytes)))}</td></tr>")
    head = (
        f"left behind: {format_bytes(left.left_bytes)} still allocated after the cell; "
        f"{format_bytes(min(left.attributed_bytes, left.left_bytes))} attributed (in {left.elapsed_s * 1000:.0f} ms)"
    )
    return f"<div><b>{e(head)}</b><table>{''.join(rows)}</table></div>"


def _loop_text(growth: LoopGrowth) -> str:
    code = f" → {growth.code.strip()}" if growth.code else ""
    called = ""
    if growth.called_from:
        called = f", called from {growth.called_from}" + (
            f" → {growth.called_from_code.strip()}" if growth.called_from_code else ""
        )
    return (
        f"  grew in a loop: about {format_bytes(growth.per_iteration_bytes, signed=True)} per iteration over "
        f"{growth.iterations} iterations ({format_bytes(growth.kept_bytes)} kept): {growth.location}{code}{called}"
    )


def one_line(measurement: Measurement, label: str = "") -> str:
    """The every-cell summary: ``cudamem [7] 1.2 s | cuda:0 peak 5.2 GiB (+4.2), Δalloc +0 B, Δreserved +6 GiB``."""
    parts = [f"cudamem {label}".rstrip(), format_seconds(measurement.wall_s)]
    if not measurement.devices:
        parts.append("no GPU memory activity" if not measurement.unavailable else "GPU not measured")
    for device in measurement.devices:
        fields = [device.device.label]
        if device.peak_allocated_bytes is not None:
            fields.append(f"peak {format_bytes(device.peak_allocated_bytes)} (+{format_bytes(device.peak_above_start_bytes)})")
            fields.append(f"Δalloc {format_bytes(device.allocated_delta_bytes, signed=True)}")
            fields.append(f"Δreserved {format_bytes(device.reserved_delta_bytes, signed=True)}")
        if device.nvml_used_delta_bytes is not None:
            fields.append(f"ΔNVML {format_bytes(device.nvml_used_delta_bytes, signed=True)}")
        parts.append(" ".join(fields))
    if measurement.error:
        parts.append(f"failed: {measurement.error}")
    return " | ".join(parts)


def _allocator_summary(device: DeviceMeasurement) -> str:
    """``cuda:0 peak 5.20 GiB (+4.20 GiB above start, 6.5% of the card), Δ allocated 0 B``: PyTorch's figures."""
    fields = [device.device.label]
    if device.peak_allocated_bytes is not None:
        cap = device.cap_bytes
        share = _percent(device.peak_allocated_bytes, device.limit_bytes)
        whole = "the card" if cap is None else f"the {format_bytes(cap)} cap"
        since = "" if device.peak_is_block_peak else ", since the last reset"
        fields.append(f"peak {format_bytes(device.peak_allocated_bytes)} (+{format_bytes(device.peak_above_start_bytes)} "
                      f"above start, {share} of {whole}{since}),")
    fields.append(f"Δ allocated {format_bytes(device.allocated_delta_bytes, signed=True)}")
    return " ".join(fields)


def _nvml_summary(device: DeviceMeasurement) -> str:
    """``cuda:0 used +6.02 GiB (PyTorch reserved +6.00 GiB, outside it +20.00 MiB), 73.16 GiB free``."""
    split = []
    if device.reserved_delta_bytes is not None:
        split.append(f"PyTorch reserved {format_bytes(device.reserved_delta_bytes, signed=True)}")
    outside = device.outside_pytorch_delta_bytes
    if outside is not None and device.reserved_delta_bytes is not None:
        split.append(f"outside PyTorch {format_bytes(outside, signed=True)}")
    if device.process_delta_bytes is None and device.before.nvml is not None:
        split.append("whole device")
    text = f"{device.device.label} used {format_bytes(device.nvml_used_delta_bytes, signed=True)}"
    text += f" ({', '.join(split)})" if split else ""
    if device.free_after_bytes is not None:
        under = "" if device.cap_bytes is None else " under the cap"
        text += f", {format_bytes(device.free_after_bytes)} free{under}"
    return text


@dataclass(repr=False)
class CellReport(TextReport):
    """What ``%%cudamem`` shows and what ``-o`` returns: the measurement with its hints and trace."""

    measurement: Measurement
    label: str = ""
    traces: tuple[TraceSummary, ...] = ()
    left: LeftBehind | None = None
    growth: RunGrowth | None = None
    breakdowns: tuple[Breakdown, ...] = ()  # where the peak went, per device (%%cudamem --breakdown)
    # How it is shown: three lines first, the rest with ``verbose`` (in HTML, behind a disclosure).
    verbose: bool = False

    @cached_property
    def hints(self) -> list[str]:
        """The hints shown under the figures: worked out when first shown or asked for, not as the cell
        ends (a ``--quiet`` cell never shows them)."""
        return measurement_hints(self.measurement, left_attributed=self.left is not None)

    # Shortcuts for the common question "what was the peak?"
    @property
    def peak_allocated_bytes(self) -> int | None:
        return self.measurement.peak_allocated_bytes

    @property
    def devices(self) -> tuple[DeviceMeasurement, ...]:
        return self.measurement.devices

    @property
    def breakdown(self) -> Breakdown | None:
        """Where the peak went on the first device measured with ``--breakdown``; ``None`` without it."""
        return self.breakdowns[0] if self.breakdowns else None

    def _title(self) -> str:
        title = f"cudamem {self.label}".rstrip() + f" · {format_seconds(self.measurement.wall_s)}"
        if self.measurement.limit_bytes:
            title += f" · PyTorch capped at {format_bytes(self.measurement.limit_bytes)}"
        if self.measurement.error:
            title += f" · failed with {self.measurement.error}"
        return title

    def _notes(self) -> list[str]:
        notes = [f"not measured: {reason}" for reason in self.measurement.unavailable]
        footnotes = dict.fromkeys(total_footnote(d) for d in self.measurement.devices)
        notes.extend(f"¹ {footnote}" for footnote in footnotes if footnote)
        if not self.measurement.devices and not self.measurement.unavailable:
            notes.append("no GPU memory activity in this cell")
        return notes

    # -- the three lines a person reads first ----------------------------------------------------
    def lead(self) -> tuple[str, str, str]:
        """The cell's peak and change per device from PyTorch's allocator; what NVML saw beyond it; the one
        finding that matters (an OOM, a leak, what it left, growth across runs, what it freed, or nothing left behind)."""
        measurement = self.measurement
        allocator = "; ".join(_allocator_summary(d) for d in measurement.devices if d.after.allocator is not None)
        if not allocator:
            allocator = "no GPU memory activity" if not measurement.unavailable else "GPU memory not measured"
        nvml = "; ".join(_nvml_summary(d) for d in measurement.devices if d.nvml_used_delta_bytes is not None)
        unmeasured = "not measured: " + "; ".join(measurement.unavailable) if measurement.unavailable else ""
        if nvml:
            beyond = f"NVML: {nvml}" + (f"; {unmeasured}" if unmeasured else "")
        else:
            beyond = unmeasured[:1].upper() + unmeasured[1:] if unmeasured else "NVML: no change on any device"
        return f"{self._title()}: {allocator}", beyond, self._finding()

    def _finding(self) -> str:
        """The first of these that holds: out of memory; who holds what the cell left (a leak first, with what
        to change); growth across runs; memory left that nobody was named for; memory freed; nothing left behind."""
        measurement = self.measurement
        if measurement.error in ("OutOfMemoryError", "OutOfMemory"):
            return "Ran out of GPU memory: run %oomfix in the next cell to diagnose and fix it"
        if self.left is not None and (self.left.leaks or self.growth is None):
            finding = left_finding(self.left)
            return finding[:1].upper() + finding[1:]
        if self.growth is not None:
            return self.growth.describe()[:1].upper() + self.growth.describe()[1:]
        left = measurement.left_allocated_bytes
        if left:
            return (f"Left {format_bytes(left)} allocated; who holds it is named from "
                    "%config CudaMem.attribute_threshold up")
        if not any(d.after.allocator is not None for d in measurement.devices):
            return "Nothing measured: the cell ran as a plain cell" if measurement.unavailable else "Nothing left behind"
        freed = -sum(min(d.allocated_delta_bytes or 0, 0) for d in measurement.devices)
        if freed:
            return f"Freed {format_bytes(freed)}: allocated is below where it started"
        outside = sum(d.outside_pytorch_delta_bytes or 0 for d in measurement.devices if d.process_delta_bytes is not None)
        if outside >= _OUTSIDE_NOTED_BYTES:
            return (f"Left {format_bytes(outside)} outside PyTorch (another library's memory, or CUDA's own), "
                    "which NVML sees: PyTorch's allocated is back where it started")
        return "Nothing left behind: allocated is back where it started"

    def _hidden(self) -> str:
        """What ``--verbose`` (or the HTML's disclosure) adds, in words."""
        parts = ["the figures per device"] if self.measurement.devices else []
        parts += ["who holds what it left"] if self.left is not None else []
        parts += ["growth across runs"] if self.growth is not None else []
        parts += ["where the peak went"] if self.breakdowns else []
        parts += ["the allocation sites"] if self.traces else []
        hints = len(self.hints)
        parts += [f"{hints} hint{'s' if hints != 1 else ''}"] if hints else []
        parts += ["notes"] if any(note.startswith("¹") for note in self._notes()) else []  # the rest are in the lead
        if not parts:
            return ""
        return ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1]

    def text(self) -> str:
        lines = list(self.lead())
        hidden = self._hidden()
        if self.verbose:
            details = self.details_text()
            return "\n".join(lines + ([details] if details else []))
        if hidden:
            lines.append(more_line(hidden, "CudaMem"))
        return "\n".join(lines)

    def details_text(self) -> str:
        """Everything behind the three lines: each device's figures, who holds what the cell left, growth,
        where the peak went, the trace, hints and notes."""
        lines = []
        for device in self.measurement.devices:
            lines.append(f"  {device.device.label} {device.device.name}")
            for metric, value, detail in _rows(device, self.measurement.limit_bytes):
                lines.append(f"    {metric:<15}{value:>12}   {detail}".rstrip())
        if self.left is not None:
            lines.extend(left_lines(self.left))
        if self.growth is not None:
            lines.append(f"  {self.growth.describe()}")
        if self.breakdowns:
            from .breakdown import breakdown_lines

            for breakdown in self.breakdowns:
                lines.extend(breakdown_lines(breakdown))
        for trace in self.traces:
            lines.extend(_trace_text(trace))
        lines.extend(f"  hint: {hint}" for hint in self.hints)
        lines.extend(f"  {note}" for note in self._notes())
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        escape = html.escape
        first, beyond, finding = self.lead()
        parts = [_STYLE, '<div class="cudamem-report">', f"<b>{escape(first)}</b><br>{escape(beyond)}<br>"]
        alarm = self.measurement.error is not None or self.growth is not None or bool(self.left and self.left.leaks)
        parts.append(f'<span class="{"leak" if alarm else "result"}">{escape(finding)}</span>')
        hidden = self._hidden()
        if hidden:
            parts.append(disclosure_html(hidden, self.details_html(), self.verbose))
        parts.append("</div>")
        return "".join(parts)

    def details_html(self) -> str:
        escape = html.escape
        parts = []
        devices = self.measurement.devices
        if devices:
            limit = self.measurement.limit_bytes
            rows = [{metric: (value, detail) for metric, value, detail in _rows(d, limit)} for d in devices]
            metrics: list[str] = []
            for device_rows in rows:
                metrics.extend(metric for metric in device_rows if metric not in metrics)
            header = "".join(f"<th>{escape(d.device.label)} {escape(d.device.name)}</th>" for d in devices)
            parts.append(f"<table><tr><th></th>{header}</tr>")
            for metric in metrics:
                cells = []
                for device_rows in rows:
                    value, detail = device_rows.get(metric, ("", ""))
                    cells.append(f'<td title="{escape(detail)}">{escape(value)} <span class="note">{escape(detail)}</span></td>')
                parts.append(f"<tr><td>{escape(metric)}</td>{''.join(cells)}</tr>")
            parts.append("</table>")
        if self.left is not None:
            parts.append(_left_html(self.left))
        if self.growth is not None:
            parts.append(f'<div class="hint">{escape(self.growth.describe())}</div>')
        if self.breakdowns:
            from .breakdown import breakdown_html

            parts.extend(breakdown_html(breakdown) for breakdown in self.breakdowns)
        for trace in self.traces:
            parts.append("<div>" + "<br>".join(escape(line.strip()) for line in _trace_text(trace)) + "</div>")
        parts.extend(f'<div class="hint">hint: {escape(hint)}</div>' for hint in self.hints)
        parts.extend(f'<div class="note">{escape(note)}</div>' for note in self._notes())
        return "".join(parts)


def _trace_text(trace: TraceSummary) -> list[str]:
    lines = [f"  top allocation sites at the peak on cuda:{trace.device_index} (traced peak {format_bytes(trace.traced_peak_bytes)}):"]
    if not trace.sites:
        lines.append("    no allocation was recorded while tracing")
    for site in trace.sites:
        code = f"  →  {site.code.strip()}" if site.code else ""
        lines.append(f"    {format_bytes(site.bytes_at_peak):>11}  {site.location} ({site.allocations} alloc){code}")
    if trace.growth is not None:
        lines.append(_loop_text(trace.growth))
    if trace.snapshot_path:
        lines.append(f"    snapshot: {trace.snapshot_path} (open it at https://pytorch.org/memory_viz)")
    return lines
