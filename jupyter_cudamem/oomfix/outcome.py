"""What ``%oomfix`` did or would do (``TryResult``: one rerun; ``Outcome``: the fix; ``BatchPlan``: the
``--dry-run`` plan), as data for the driver to fill and the magic to show, as text and as HTML."""

from __future__ import annotations

import functools
import html
from dataclasses import dataclass, field
from ..advice import Suggestion
from ..batch import Knob
from ..cell.edit import CellDiff, unified_diff
from ..report.text import TextReport, disclosure_html, more_line
from ..units import format_bytes, format_seconds
from ..growth.replay import RecordedRun
from ..batchsearch import Observation
from .strategies import STRATEGY_TITLES, Strategy
from .whole_data import CHUNKED_NOTE


@dataclass(frozen=True)
class BatchPlan:
    """The batch strategy's plan: the knob, its first try, and the cells that try changes."""

    summary: str
    knob: Knob | None
    first_batch: int | None
    first_reason: str
    diffs: tuple[CellDiff, ...]
    strategies: tuple[Strategy, ...]
    notes: tuple[str, ...] = ()

    def lines(self) -> list[str]:
        lines = [f"plan: {', '.join(STRATEGY_TITLES[s] for s in self.strategies)}, in that order"]
        if Strategy.BATCH in self.strategies:
            if self.knob is None:
                lines.append(f"  smaller batch: nothing to shrink ({self.summary})")
            else:
                knob = self.knob
                lines.append(f"  smaller batch: {knob.label} = {knob.value} ({knob.kind.value}, "
                             f"{knob.origin or 'origin unknown'})")
                if knob.evidence:
                    lines.append(f"    because it is {', '.join(knob.evidence)}")
                first = self.first_reason if self.first_batch is None else (
                    f"{knob.label} = {self.first_batch} ({self.first_reason})")
                lines.append(f"    first try: {first}")
                for diff in self.diffs:
                    lines += ["    " + line for line in diff.diff.rstrip("\n").splitlines()]
                others = self.summary.partition("; also seen: ")[2]
                if others:
                    lines.append(f"    also seen: {others}")
        lines += [f"  note: {note}" for note in self.notes]
        return lines

    def html(self) -> str:
        e = html.escape
        parts = [f"<p><b>Plan</b>: {e(', '.join(STRATEGY_TITLES[s] for s in self.strategies))}, in that order.</p>"]
        if Strategy.BATCH in self.strategies:
            if self.knob is None:
                parts.append(f"<p>Smaller batch: nothing to shrink ({e(self.summary)}).</p>")
            else:
                knob = self.knob
                first = f"first try: {e(self.first_reason)}" if self.first_batch is None else (
                    f"first try <code>{e(knob.label)} = {self.first_batch}</code> ({e(self.first_reason)})")
                parts.append(
                    f"<p>Smaller batch: <code>{e(knob.label)} = {knob.value}</code> ({e(knob.kind.value)}, "
                    f"{e(knob.origin or 'origin unknown')}); {first}.</p>"
                )
                parts += [diff_html(d.diff) for d in self.diffs]
        parts += [f"<p><i>{e(note)}</i></p>" for note in self.notes]
        return "".join(parts)


@dataclass(frozen=True)
class FailureSite:
    """Where in the cell a try's OOM arose: the cell's line, and whether inside a model's forward pass."""

    line: int
    in_module: bool


@dataclass(frozen=True)
class TryResult:
    """One rerun: what ran, whether it fitted, and what it measured."""

    number: int
    strategy: Strategy
    source: str
    fitted: bool
    out_of_memory: bool
    peak_bytes: int | None  # peak allocated above what was allocated when the try started
    wall_s: float
    reason: str
    batch: int | None = None
    error: str | None = None  # one line for a failure that was not an OOM
    # Allocated at its start; the least it needed (for an OOM); what it left above its start once cleaned up.
    allocated_at_start_bytes: int | None = None
    need_bytes: int | None = None
    left_bytes: int | None = None
    # How far above the fix's reference level the try started (state an earlier try left).
    start_above_reference_bytes: int = 0
    # For an OOM: what PyTorch held reserved but unallocated when it failed (its OOM message's figure).
    stuck_bytes: int | None = None
    recorded: RecordedRun | None = field(default=None, repr=False, compare=False)
    failed_at: FailureSite | None = None  # for an OOM, where in the cell it arose
    # Whether it ran as the cell's next run will, holding what the try that fitted before it made and bound.
    steady: bool = False

    def observation(self) -> Observation:
        """What the batch search learns from this try, measured from the fix's reference level."""
        offset = self.start_above_reference_bytes
        peak, need = (None if value is None else value + offset for value in (self.peak_bytes, self.need_bytes))
        if self.fitted:
            return Observation(True, peak_bytes=peak, start_bytes=offset, recorded=self.recorded)
        return Observation(False, need_bytes=need, held_bytes=peak, start_bytes=offset, stuck_bytes=self.stuck_bytes,
                           recorded=self.recorded)

    @property
    def verdict(self) -> str:
        return "fitted" if self.fitted else "out of memory" if self.out_of_memory else f"failed: {self.error}"

    def cells(self) -> tuple[str, str, str, str, str, str]:
        """The try's row in the tries' table, for the text and the HTML: strategy, batch, result, peak, time, why."""
        return (STRATEGY_TITLES[self.strategy], "" if self.batch is None else str(self.batch), self.verdict,
                format_bytes(self.peak_bytes), format_seconds(self.wall_s), user_reason(self.reason))


_DIFF_STYLES = {"+": " style='background:#e6ffed'", "-": " style='background:#ffeef0'"}


def diff_html(diff: str) -> str:
    """A unified diff as HTML, added lines green and removed ones red (the two file lines plain)."""
    lines = []
    for line in diff.splitlines():
        style = "" if line[:3] in ("+++", "---") else _DIFF_STYLES.get(line[:1], "")
        lines.append(f"<span{style}>{html.escape(line)}</span>")
    return "<pre>" + "\n".join(lines) + "</pre>"


DETAILS = "the diagnosis's figures and holders, every try, the diff, notes and advice"

# The batch search's reasons in the user's words.
_REASON_WORDS = (
    ("line through measured peaks", "predicted from the measured peaks"),
    ("bisection", "halfway between what fitted and what failed"),
    ("probe", "a small first try, to measure memory per sample"),
    ("(line through it and zero)", "(all of it taken as growing with the batch)"),
    ("(line through it and its parameters)", "(all but the parameters the cell builds taken as growing with the batch)"),
)


def user_reason(reason: str) -> str:
    """A try's reason as the user reads it (the search names its own method otherwise)."""
    for internal, words in _REASON_WORDS:
        reason = reason.replace(internal, words, 1)
    return reason


@dataclass(frozen=True, repr=False)
class Outcome(TextReport):
    """What ``%oomfix`` did. ``cell_diffs``: one diff per cell whose text sets the batch (empty: the diff is
    between the failed cell and the one that fitted); ``paste_code``: what ``--apply`` offers instead of it."""

    original_source: str
    fixed_source: str | None
    strategy: Strategy | None  # the strategy that fitted
    tries: tuple[TryResult, ...]
    batch_before: int | None = None
    batch_after: int | None = None
    batch_summary: str = ""
    budget_bytes: int | None = None
    freed_bytes: int | None = None
    suggestions: tuple[Suggestion, ...] = ()
    notes: tuple[str, ...] = ()
    dry_run: bool = False
    diagnosis: object | None = field(default=None, compare=False)
    cell_diffs: tuple[CellDiff, ...] = ()
    paste_code: str | None = None
    plan: BatchPlan | None = field(default=None, compare=False)
    cleanup_note: str | None = None  # why the cleanup freed more or less than the diagnosis listed ("": it did not)
    verbose: bool = False
    cell_name: str = "the cell"  # In[k] where known
    kept: bool = False  # the namespace holds what the try that fitted made (it was the last try)
    applied: bool = False  # ``--apply`` put the change in the next input

    @property
    def fitted(self) -> bool:
        return self.fixed_source is not None

    @functools.cached_property
    def changed(self) -> bool:
        if self.cell_diffs:
            return any(d.changed for d in self.cell_diffs)
        return self.fixed_source is not None and self.fixed_source.splitlines() != self.original_source.splitlines()

    @functools.cached_property
    def diff(self) -> str:
        """Made once: the text, the HTML and ``-o``'s ``.diff`` show it."""
        if self.cell_diffs:
            return "".join(d.diff for d in self.cell_diffs)
        if not self.changed:
            return ""
        return unified_diff(self.original_source, self.fixed_source or "")

    @property
    def paste(self) -> str | None:
        """What ``--apply`` puts in the next input: the changed cells, or the cell that fitted."""
        return self.paste_code if self.paste_code is not None else self.fixed_source

    @property
    def reruns(self) -> int:
        return len(self.tries)

    @property
    def _count(self) -> str:
        return f"{self.reruns} rerun{'s' if self.reruns != 1 else ''}"

    @property
    def _chunked(self) -> bool:
        return self.strategy is Strategy.BATCH and any(note.startswith(CHUNKED_NOTE) for note in self.notes)

    def headline(self) -> str:
        if self.dry_run:
            return "%oomfix --dry-run: diagnosis only, nothing was rerun"
        count = self._count
        if not self.fitted:
            return f"%oomfix: nothing fitted after {count}"
        if self._chunked:
            return f"%oomfix: fits in chunks of {self.batch_after} rows (all {self.batch_before} computed) after {count}"
        if self.strategy is Strategy.BATCH:
            return f"%oomfix: fits with batch {self.batch_after} (was {self.batch_before}) after {count}"
        if self.strategy is Strategy.AUTOCAST:
            return f"%oomfix: fits under autocast after {count}"
        return f"%oomfix: fits unchanged after cleanup ({count})"

    def lead(self) -> tuple[str, str, str]:
        """What failed and why; what fixed it, with its proof; the change to make."""
        return self._what_failed(), self._what_fixed(), self._change()

    def _what_failed(self) -> str:
        cause = getattr(self.diagnosis, "cause", None)
        why = cause() if callable(cause) else ""
        return f"{self.cell_name} ran out of GPU memory" + (f": {why}" if why else "")

    def _fitted_try(self) -> TryResult | None:
        return next((t for t in reversed(self.tries) if t.fitted and t.source == self.fixed_source), None)

    def _what_fixed(self) -> str:
        if self.dry_run:
            return "Nothing was rerun (--dry-run); without it %oomfix frees what the failure left and reruns the cell"
        fitted = self._fitted_try()
        if fitted is None and self.fitted and self.strategy is Strategy.BATCH:
            above = max((t for t in self.tries if t.fitted and t.batch), key=lambda t: t.batch or 0)
            return (f"Fixed with batch {self.batch_after} (was {self.batch_before}): rerun #{above.number} at "
                    f"{above.batch} fitted once, and the replay of its own requests, run after run as your next runs "
                    f"will, keeps fitting {self.batch_after}")
        if fitted is None:
            return f"Not fixed: none of {self._count} fitted" if self.tries else "Not fixed: nothing was rerun"
        room = "" if self.budget_bytes is None else f" of the {format_bytes(self.budget_bytes)} free"
        proof = f"peak {format_bytes(fitted.peak_bytes)}{room}" + (
            ", holding what a run leaves, as your next runs will" if fitted.steady else "")
        if self._chunked:
            return (f"Fixed with chunks of {self.batch_after} rows (all {self.batch_before} computed): "
                    f"the rerun fitted, {proof}")
        if self.strategy is Strategy.BATCH:
            return (f"Fixed with batch {self.batch_after} (was {self.batch_before}): "
                    f"the rerun at batch {self.batch_after} fitted, {proof}")
        if self.strategy is Strategy.AUTOCAST:
            return f"Fixed under {fitted.reason}: the rerun fitted, {proof}"
        freed = "" if self.freed_bytes is None else f" (it freed {format_bytes(self.freed_bytes)})"
        return f"Fixed by the cleanup{freed}: the cell as written fitted, {proof}"

    def _edit(self) -> tuple[str, str, str] | None:
        """The change as one line's edit (which cell, the line before, after); ``None`` where more change."""
        diffs = self.cell_diffs or (
            (CellDiff(self.cell_name, self.original_source, self.fixed_source or ""),) if self.fixed_source else ())
        changed = [d for d in diffs if d.changed]
        if len(changed) != 1:
            return None
        lines = changed[0].diff.splitlines()[2:]  # below the two file lines
        removed = [line[1:] for line in lines if line.startswith("-")]
        added = [line[1:] for line in lines if line.startswith("+")]
        if len(removed) != 1 or len(added) != 1:
            return None
        where = changed[0].label if changed[0].cell_number is not None else self.cell_name
        return where, removed[0].strip(), added[0].strip()

    def _change(self) -> str:
        if self.dry_run:
            plan = self.plan
            if plan is not None and plan.knob is not None and plan.first_batch is not None:
                return f"First try: {plan.knob.label} = {plan.first_batch} ({plan.first_reason})"
            return self._advice()
        if not self.fitted:
            return self._advice()
        if not self.changed:
            return ("Nothing to change: the kernel holds what the rerun made" if self.kept
                    else "Nothing to change: run the cell again to get its results")
        edit = self._edit()
        what = f"Change {edit[0]}: {edit[1]}  ->  {edit[2]}" if edit is not None else "Paste the cell below"
        where = "it is in the next input" if self.applied else "--apply puts it in the next input"
        state = "the kernel already holds what it made" if self.kept else "run it to get its results"
        return f"{what} ({where}; {state})"

    def _advice(self) -> str:
        suggestions = tuple(getattr(self.diagnosis, "suggestions", ())) or tuple(s.title for s in self.suggestions)
        return f"Try: {suggestions[0]}" if suggestions else "No advice applies here"

    def pasted(self) -> str:
        """The cell to paste, shown under the three lines where more than one line changes."""
        if self.dry_run or not self.changed or self.applied or self._edit() is not None:
            return ""
        return (self.paste or "").rstrip("\n")

    def _facts(self) -> list[str]:
        """What the cleanup freed, the room measured and where the batch was found, for both renderings."""
        facts = []
        if self.freed_bytes is not None:
            explain = getattr(self.diagnosis, "cleanup_explanation", None)
            why = self.cleanup_note if self.cleanup_note is not None else (
                explain(self.freed_bytes) if callable(explain) else "")
            facts.append(f"cleanup freed {format_bytes(self.freed_bytes)}" + (f" ({why})" if why else ""))
        if self.budget_bytes is not None:
            facts.append(f"room for the cell {format_bytes(self.budget_bytes)}")
        if self.batch_summary and self.plan is None:
            facts.append(self.batch_summary)
        return facts

    def text(self) -> str:
        parts = list(self.lead())
        if self.pasted():
            parts += ["", self.pasted()]
        if not self.verbose:
            parts.append(more_line(DETAILS, "OomFix"))
            return "\n".join(parts)
        return "\n".join(parts + ["", self.details_text()])

    def details_text(self) -> str:
        """Everything behind the three lines: the diagnosis, the facts, the plan, every try, the diff, notes, advice."""
        parts = [self.headline()]
        if self.diagnosis is not None:
            full = getattr(self.diagnosis, "full_text", None)
            parts += ["", full() if callable(full) else str(self.diagnosis)]
        facts = self._facts()
        if facts:
            parts.append("; ".join(facts))
        if self.plan is not None:
            parts += [""] + self.plan.lines()
        if self.tries:
            parts += ["", " #  strategy        batch   result          peak        time   why"]
            for t in self.tries:
                title, batch, verdict, peak, time, why = t.cells()
                parts.append(f"{t.number:>2}  {title:<14} {batch:>6}   {verdict:<14} {peak:>11} {time:>8}   {why}")
        if self.diff:
            parts += ["", self.diff.rstrip("\n")]
        parts += [f"note: {note}" for note in self.notes]
        for suggestion in self.suggestions:
            parts += ["", f"- {suggestion.title}: {suggestion.why}"]
            if suggestion.code:
                parts += ["    " + line for line in suggestion.code.splitlines()]
        return "\n".join(parts)

    def _repr_html_(self) -> str:
        e = html.escape
        failed, fixed, change = self.lead()
        pasted = f"<pre>{e(self.pasted())}</pre>" if self.pasted() else ""
        return (
            f"<div class='cudamem-oomfix'><p><b>{e(failed)}</b><br>{e(fixed)}<br>{e(change)}</p>{pasted}"
            f"{disclosure_html(DETAILS, self.details_html(), self.verbose)}</div>"
        )

    def details_html(self) -> str:
        e = html.escape
        out = [f"<div class='cudamem-oomfix-details'><p><b>{e(self.headline())}</b></p>"]
        if self.diagnosis is not None:
            rich = getattr(self.diagnosis, "full_html", None)
            out.append(rich() if callable(rich) else f"<pre>{e(str(self.diagnosis))}</pre>")
        facts = self._facts()
        if facts:
            out.append("<p>" + "; ".join(e(fact) for fact in facts) + "</p>")
        if self.plan is not None:
            out.append(self.plan.html())
        if self.tries:
            out.append("<table><thead><tr><th>#</th><th>strategy</th><th>batch</th><th>result</th>"
                       "<th>peak</th><th>time</th><th>why</th></tr></thead><tbody>")
            for t in self.tries:
                title, batch, verdict, peak, time, why = map(e, t.cells())
                colour = "#2e7d32" if t.fitted else "#c62828"
                out.append(f"<tr><td>{t.number}</td><td>{title}</td><td>{batch}</td><td style='color:{colour}'>"
                           f"{verdict}</td><td>{peak}</td><td>{time}</td><td>{why}</td></tr>")
            out.append("</tbody></table>")
        if self.diff:
            out.append(diff_html(self.diff))
        out += [f"<p><i>{e(note)}</i></p>" for note in self.notes]
        if self.suggestions:
            items = "".join(f"<li><b>{e(s.title)}</b>: {e(s.why)}{f'<pre>{e(s.code)}</pre>' if s.code else ''}</li>"
                            for s in self.suggestions)
            out.append(f"<ul>{items}</ul>")
        out.append("</div>")
        return "".join(out)
