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
        order = ", ".join(STRATEGY_TITLES[s] for s in self.strategies)
        lines = [f"plan: {order}, in that order"]
        if Strategy.BATCH in self.strategies:
            if self.knob is None:
                lines.append(f"  smaller batch: nothing to shrink ({self.summary})")
            else:
                knob = self.knob
                lines.append(
                    f"  smaller batch: {knob.label} = {knob.value} "
                    f"({knob.kind.value}, {knob.origin or 'origin unknown'})"
                )
                if knob.evidence:
                    lines.append(f"    because it is {', '.join(knob.evidence)}")
                if self.first_batch is not None:
                    lines.append(f"    first try: {knob.label} = {self.first_batch} ({self.first_reason})")
                else:
                    lines.append(f"    first try: {self.first_reason}")
                for diff in self.diffs:
                    lines += ["    " + line for line in diff.diff.rstrip("\n").splitlines()]
                others = self.summary.partition("; also seen: ")[2]
                if others:
                    lines.append(f"    also seen: {others}")
        lines += [f"  note: {note}" for note in self.notes]
        return lines

    def html(self) -> str:
        e = html.escape
        order = ", ".join(STRATEGY_TITLES[s] for s in self.strategies)
        parts = [f"<p><b>Plan</b>: {e(order)}, in that order.</p>"]
        if Strategy.BATCH in self.strategies:
            if self.knob is None:
                parts.append(f"<p>Smaller batch: nothing to shrink ({e(self.summary)}).</p>")
            else:
                knob = self.knob
                first = (
                    f"first try <code>{e(knob.label)} = {self.first_batch}</code> ({e(self.first_reason)})"
                    if self.first_batch is not None
                    else f"first try: {e(self.first_reason)}"
                )
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

        def shifted(value: int | None) -> int | None:
            return None if value is None else value + offset

        if self.fitted:
            return Observation(True, peak_bytes=shifted(self.peak_bytes), start_bytes=offset, recorded=self.recorded)
        return Observation(False, need_bytes=shifted(self.need_bytes), held_bytes=shifted(self.peak_bytes),
                           start_bytes=offset, stuck_bytes=self.stuck_bytes, recorded=self.recorded)

    @property
    def verdict(self) -> str:
        if self.fitted:
            return "fitted"
        if self.out_of_memory:
            return "out of memory"
        return f"failed: {self.error}"


def diff_html(diff: str) -> str:
    """A unified diff as HTML, added lines green and removed ones red."""
    lines = []
    for line in diff.splitlines():
        style = ""
        if line.startswith("+") and not line.startswith("+++"):
            style = " style='background:#e6ffed'"
        elif line.startswith("-") and not line.startswith("---"):
            style = " style='background:#ffeef0'"
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

    # -- the three lines a person reads first ----------------------------------------------------
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
        state = ("the kernel already holds what it made" if self.kept
                 else "run it to get its results")
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

    # -- text -----------------------------------------------------------------------------------
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
            parts.append("")
            parts.append(" #  strategy        batch   result          peak        time   why")
            for t in self.tries:
                batch = "" if t.batch is None else str(t.batch)
                parts.append(
                    f"{t.number:>2}  {STRATEGY_TITLES[t.strategy]:<14} {batch:>6}   "
                    f"{t.verdict:<14} {format_bytes(t.peak_bytes):>11} {format_seconds(t.wall_s):>8}   {user_reason(t.reason)}"
                )
        if self.diff:
            parts += ["", self.diff.rstrip("\n")]
        for note in self.notes:
            parts.append(f"note: {note}")
        for suggestion in self.suggestions:
            parts += ["", f"- {suggestion.title}: {suggestion.why}"]
            if suggestion.code:
                parts += ["    " + line for line in suggestion.code.splitlines()]
        return "\n".join(parts)

    # -- HTML -----------------------------------------------------------------------------------
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
            out.append(
                "<table><thead><tr><th>#</th><th>strategy</th><th>batch</th><th>result</th>"
                "<th>peak</th><th>time</th><th>why</th></tr></thead><tbody>"
            )
            for t in self.tries:
                colour = "#2e7d32" if t.fitted else "#c62828"
                out.append(
                    f"<tr><td>{t.number}</td><td>{e(STRATEGY_TITLES[t.strategy])}</td>"
                    f"<td>{'' if t.batch is None else t.batch}</td>"
                    f"<td style='color:{colour}'>{e(t.verdict)}</td><td>{e(format_bytes(t.peak_bytes))}</td>"
                    f"<td>{e(format_seconds(t.wall_s))}</td><td>{e(user_reason(t.reason))}</td></tr>"
                )
            out.append("</tbody></table>")
        if self.diff:
            out.append(diff_html(self.diff))
        for note in self.notes:
            out.append(f"<p><i>{e(note)}</i></p>")
        if self.suggestions:
            out.append("<ul>")
            for s in self.suggestions:
                code = f"<pre>{e(s.code)}</pre>" if s.code else ""
                out.append(f"<li><b>{e(s.title)}</b>: {e(s.why)}{code}</li>")
            out.append("</ul>")
        out.append("</div>")
        return "".join(out)
