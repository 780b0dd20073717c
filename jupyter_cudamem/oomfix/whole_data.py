"""What ``%oomfix`` does when the batch is the data itself (``batch.whole.covers_whole_data``): each model
call over the data run over chunks and joined (``Join``), the search shrinking the chunk so every row is
computed; or a refusal, never a smaller batch that would leave a partial result.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from enum import Enum

from ..batch.knobs import BatchFinding, Knob, KnobKind, ModelCall, Written
from ..batch.whole import WholeData, covers_whole_data
from ..cell.source import Span, line_ending, split_lines

CHUNK_LABEL = "rows per chunk"
CHUNKED_NOTE = "the batch is the data: "  # how the note of a chunked fix begins (the outcome's headline reads it)
_CHUNK_VARIABLE = "_chunk"
# The attributes and constant subscripts the cell takes from a call's output right after it (``.logits``,
# ``[0]``, ``["hidden"]``), up to the first method call (``.argmax(...)`` stays outside).
_TAKEN = re.compile(r"""(?:\.[A-Za-z_]\w*(?!\w|\s*\()|\[\s*(?:\d+|'[^'\]]*'|"[^"\]]*")\s*\])+""")


class Join(Enum):
    """Where the chunks' results are joined, and where the joined result is left."""

    ON_DEVICE = "on the GPU"  # data written as an expression the rewrite must not evaluate twice
    THROUGH_HOST = "on the host, then moved back to the data's device"
    ON_HOST = "on the host, and left there"


@dataclass(frozen=True)
class WholeDataDecision:
    """``chunked``: the finding whose knob is the chunk size of the rewritten cell; ``None`` for a refusal.
    ``note``: the one line the outcome shows either way."""

    whole: WholeData
    note: str
    chunked: BatchFinding | None
    on_host: BatchFinding | None = None  # the same chunks with the result left on the host (see ``Join``)


def _parsed(data: str) -> ast.expr | None:
    try:
        return ast.parse(data, mode="eval").body
    except SyntaxError:
        return None


def _evaluated_once(data: str) -> bool:
    """Whether ``data`` may be written twice (``x.split(n)`` and ``x.device``): a name, an attribute or a
    subscript of one, never a call that would make the data again."""
    node = _parsed(data)
    return node is not None and all(isinstance(n, (ast.Name, ast.Attribute, ast.Subscript, ast.Load, ast.Slice,
                                                   ast.Constant, ast.Tuple, ast.UnaryOp, ast.USub))
                                    for n in ast.walk(node))


def join_of(whole: WholeData, keep_on_host: bool = False) -> Join:
    """How ``chunked_source`` joins ``whole.calls``: on the host where it can name the data's device."""
    if keep_on_host:
        return Join.ON_HOST
    return Join.THROUGH_HOST if all(_evaluated_once(call.data) for call in whole.calls) else Join.ON_DEVICE


def chunked_source(source: str, whole: WholeData, rows: int,
                   join: Join = Join.ON_DEVICE) -> tuple[str, tuple[Written, ...]]:
    """``source`` with each of ``whole.calls`` run over chunks of ``rows`` rows and joined as ``join`` says,
    and where each written chunk size sits (so the batch search can change it)."""
    lines = split_lines(source)
    written: list[Written] = []
    by_line: dict[int, list[ModelCall]] = {}
    for call in whole.calls:
        by_line.setdefault(call.span.line, []).append(call)
    for line_number, calls in by_line.items():
        text = lines[line_number - 1]
        shift = 0
        for call in sorted(calls, key=lambda c: c.span.col):
            bare = isinstance(_parsed(call.data), (ast.Name, ast.Attribute, ast.Subscript, ast.Call))
            data = call.data if bare else f"({call.data})"
            start, end = call.span.col + shift, call.span.end_col + shift
            # ``model(x).logits``: joined by the tensor the cell takes from each chunk's output.
            taken = found.group(0) if (found := _TAKEN.match(text[end:])) else ""
            host = "" if join is Join.ON_DEVICE else ".cpu()"
            head = (f"torch.cat([{call.callee}({_CHUNK_VARIABLE}){taken}.detach(){host} for {_CHUNK_VARIABLE} "
                    f"in {data}.split(")
            back = f".to({data}.device)" if join is Join.THROUGH_HOST else ""
            replacement = f"{head}{rows})]){back}"
            text = text[:start] + replacement + text[end + len(taken):]
            number_col = start + len(head)
            written.append(Written(None, Span(line_number, number_col, number_col + len(str(rows)))))
            shift += len(replacement) - (call.span.end_col - call.span.col) - len(taken)
        lines[line_number - 1] = text
    result = "".join(lines)
    if source and not result.endswith(("\n", "\r")) and source.endswith(("\n", "\r")):
        result += line_ending(source)
    return result, tuple(written)



def whole_data_decision(finding: BatchFinding, namespace: Mapping[str, object] | None = None,
                        transform: Callable[[str], str] | None = None) -> WholeDataDecision | None:
    """``None`` when a smaller batch is a fix; else chunks over all the data, or a refusal.
    ``finding.whole_data`` is used where it was decided for the knob chosen now."""
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
    join = join_of(whole)

    def written_in(keep_on_host: bool) -> BatchFinding:
        source, written = chunked_source(finding.source, whole, whole.rows or 0, join_of(whole, keep_on_host))
        knob = Knob(CHUNK_LABEL, whole.rows or 0, KnobKind.CELL, "split", 1, written, (),
                    f"line {written[0].span.line}", ("a split size", "the batch is the data: chunks keep every row"))
        return replace(finding, source=source, knobs=(knob,), problem=None, whole_data=whole)

    note = (
        f"{CHUNKED_NOTE}{whole.reason}; so %oomfix runs "
        + ", ".join(f"{call.callee}(...)" for call in whole.calls)
        + f" over chunks of the rows and joins them (torch.cat) {join.value}, shrinking the chunk instead: "
        "every row is computed"
    )
    on_host = written_in(True) if join is Join.THROUGH_HOST else None
    return WholeDataDecision(whole, note, written_in(False), on_host)


def kept_on_host_note(rows: int | None, chunk: int) -> str:
    """The note of a switch to ``WholeDataDecision.on_host`` after the move back ran out of memory."""
    over = f"all {rows:,} rows" if rows else "all the rows"
    return (
        f"the joined result of {over} did not fit on the GPU beside the rest (moving it back ran out of memory "
        f"after chunks of {chunk:,} had fitted): the chunks' results stay on the host (.cpu()), where the "
        "cell's names hold them; move them to the GPU once there is room"
    )
