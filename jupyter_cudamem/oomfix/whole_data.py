"""What ``%oomfix`` does when the batch is the data itself: chunks that cover all of it, or a refusal.

``batch.whole.covers_whole_data`` decides whether a smaller batch would only compute a smaller result
(an inference cell, a metric over a whole tensor). Then shrinking the batch is never tried: a rerun
that fits with 12,923 of 32,768 rows would leave the cell's names holding a partial result. Instead
each model call over the data is rewritten to run over chunks of it and join them,

    predictions = classifier(features).argmax(dim=1)
    predictions = torch.cat([classifier(_chunk).detach() for _chunk in features.split(32768)]).argmax(dim=1)

and the batch search shrinks the chunk, not the data: every row is computed whatever size fits. The
chunk's output is detached so each chunk's autograd graph (kept for a backward pass the cell never
runs) is freed before the next chunk; the cell does not train, so nothing needed it. Where the rewrite
is not safe (the result is not a model's, the call is in a loop or spans lines), ``%oomfix`` says in
one line why it will not shrink the batch, and tries the other strategies (a plain rerun, autocast),
which keep every row.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..batch.knobs import BatchFinding, Knob, KnobKind, Written
from ..batch.whole import WholeData, covers_whole_data
from ..cell.source import Span, line_ending, split_lines

CHUNK_LABEL = "rows per chunk"
CHUNKED_NOTE = "the batch is the data: "  # how the note of a chunked fix begins (the outcome's headline reads it)
_CHUNK_VARIABLE = "_chunk"


@dataclass(frozen=True)
class WholeDataDecision:
    """``chunked``: the finding whose knob is the chunk size of the rewritten cell; ``None`` for a refusal.
    ``note``: the one line the outcome shows either way."""

    whole: WholeData
    note: str
    chunked: BatchFinding | None

    @property
    def refused(self) -> bool:
        return self.chunked is None


def _needs_parentheses(data: str) -> bool:
    try:
        node = ast.parse(data, mode="eval").body
    except SyntaxError:
        return True
    return not isinstance(node, (ast.Name, ast.Attribute, ast.Subscript, ast.Call))


def chunked_source(source: str, whole: WholeData, rows: int) -> tuple[str, tuple[Written, ...]]:
    """``source`` with each of ``whole.calls`` run over chunks of ``rows`` rows, and where each written
    chunk size sits (so the batch search can change it)."""
    lines = split_lines(source)
    written: list[Written] = []
    by_line: dict[int, list[Any]] = {}
    for call in whole.calls:
        by_line.setdefault(call.span.line, []).append(call)
    for line_number, calls in by_line.items():
        text = lines[line_number - 1]
        shift = 0
        for call in sorted(calls, key=lambda c: c.span.col):
            data = f"({call.data})" if _needs_parentheses(call.data) else call.data
            start, end = call.span.col + shift, call.span.end_col + shift
            # ``model(x).logits``: a model that returns an output object (transformers' ModelOutput, a
            # tuple) is joined by the tensor the cell takes from it, taken from each chunk's output.
            taken = _taken_from_output(text[end:])
            head = (f"torch.cat([{call.callee}({_CHUNK_VARIABLE}){taken}.detach() for {_CHUNK_VARIABLE} "
                    f"in {data}.split(")
            replacement = f"{head}{rows})])"
            text = text[:start] + replacement + text[end + len(taken):]
            number_col = start + len(head)
            written.append(Written(None, Span(line_number, number_col, number_col + len(str(rows)))))
            shift += len(replacement) - (call.span.end_col - call.span.col) - len(taken)
        lines[line_number - 1] = text
    result = "".join(lines)
    if source and not result.endswith(("\n", "\r")) and source.endswith(("\n", "\r")):
        result += line_ending(source)
    return result, tuple(written)


_TAKEN = re.compile(r"""(?:\.[A-Za-z_]\w*(?!\w|\s*\()|\[\s*(?:\d+|'[^'\]]*'|"[^"\]]*")\s*\])+""")


def _taken_from_output(rest: str) -> str:
    """The attributes and constant subscripts the cell takes from a call's output right after it
    (``.logits``, ``[0]``, ``["hidden"]``), up to the first method call (``.argmax(...)`` stays outside)."""
    found = _TAKEN.match(rest)
    return found.group(0) if found else ""


def whole_data_decision(
    finding: BatchFinding,
    namespace: Mapping[str, Any] | None = None,
    transform: Callable[[str], str] | None = None,
) -> WholeDataDecision | None:
    """``None`` when a smaller batch is a fix; else chunks over all the data, or a refusal (see the module
    docstring). ``finding.whole_data`` is used when it was decided for the knob chosen now (as ``find_batch``
    decides it)."""
    whole = finding.whole_data
    chosen = finding.chosen
    stale = whole is not None and chosen is not None and whole.knob != chosen.label
    if stale or (whole is None and not finding.whole_data_decided):
        whole = covers_whole_data(finding, namespace, transform)
    if whole is None:
        return None
    if not whole.chunkable or not whole.rows or whole.rows < 2:
        why = whole.problem or "the number of rows is unknown"
        note = f"%oomfix does not shrink the batch: {whole.reason}; nor can it split the work into chunks ({why})"
        return WholeDataDecision(whole, note, None)
    source, written = chunked_source(finding.source, whole, whole.rows)
    knob = Knob(
        CHUNK_LABEL,
        whole.rows,
        KnobKind.CELL,
        "split",
        1,
        written,
        (),
        f"line {written[0].span.line}",
        ("a split size", "the batch is the data: chunks keep every row"),
    )
    note = (
        f"{CHUNKED_NOTE}{whole.reason}; so %oomfix runs "
        + ", ".join(f"{call.callee}(...)" for call in whole.calls)
        + " over chunks of the rows and joins them (torch.cat), shrinking the chunk instead: every row is computed"
    )
    chunked = replace(finding, source=source, knobs=(knob,), problem=None, whole_data=whole)
    return WholeDataDecision(whole, note, chunked)
