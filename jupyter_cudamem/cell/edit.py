"""Change a cell's text in exactly the places meant, and show the change as a diff.

Every change ``%oomfix`` makes to code goes through here: a number replaced at its span (a batch
size in the failed cell or in an earlier ``In[k]``), a line inserted, the whole body wrapped in
``torch.autocast``. Nothing else in the text moves.
"""

from __future__ import annotations

import difflib
import io
import tokenize
from collections.abc import Iterable
from dataclasses import dataclass

from .source import ParsedCell, Span, Transform, line_ending, parse_cell, split_lines


@dataclass(frozen=True)
class Edit:
    """Replace the text at ``span`` with ``text`` (an empty span inserts)."""

    span: Span
    text: str


def apply_edits(source: str, edits: Iterable[Edit]) -> str:
    """``source`` with every edit made; edits on one line are made right to left so columns stay valid."""
    lines = split_lines(source)
    for edit in sorted(set(edits), key=lambda e: (e.span.line, e.span.col, e.span.end_col), reverse=True):
        if not 0 < edit.span.line <= len(lines):
            raise ValueError(f"line {edit.span.line} is not in the cell ({len(lines)} lines)")
        text = lines[edit.span.line - 1]
        lines[edit.span.line - 1] = text[: edit.span.col] + edit.text + text[edit.span.end_col :]
    return "".join(lines)


def insert_line(source: str, line: int, text: str) -> str:
    """``source`` with ``text`` (no line ending) inserted as a new line before raw line ``line``."""
    lines = split_lines(source)
    newline = line_ending(source)
    index = max(line - 1, 0)
    if index > 0 and index <= len(lines) and not lines[index - 1].endswith(("\n", "\r")):
        lines[index - 1] += newline
    return "".join(lines[:index] + [text + newline] + lines[index:])


def unified_diff(
    before: str, after: str, name: str = "cell", before_label: str = "failed", after_label: str = "fits"
) -> str:
    """A unified diff of two versions of a cell, for display."""
    diff = difflib.unified_diff(
        before.splitlines(keepends=True),
        after.splitlines(keepends=True),
        fromfile=f"{name} ({before_label})",
        tofile=f"{name} ({after_label})",
    )
    return "".join(line if line.endswith("\n") else line + "\n" for line in diff)


@dataclass(frozen=True)
class CellDiff:
    """One cell as it is and as it should be: the failed cell itself or an earlier ``In[k]``."""

    label: str  # "the failed cell" or "In[3]"
    before: str
    after: str
    cell_number: int | None = None  # k of In[k]; None for the failed cell

    @property
    def changed(self) -> bool:
        return self.before != self.after

    @property
    def diff(self) -> str:
        return unified_diff(self.before, self.after, self.label, "as run", "changed") if self.changed else ""


# -- autocast -------------------------------------------------------------------------------------
def _string_continuation_lines(python: str) -> set[int]:
    """1-based lines that continue a multi-line string token: indenting them would change the string."""
    inside: set[int] = set()
    try:
        for token in tokenize.generate_tokens(io.StringIO(python).readline):
            if token.type == tokenize.STRING or getattr(tokenize, "FSTRING_MIDDLE", -1) == token.type:
                inside.update(range(token.start[0] + 1, token.end[0] + 1))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        pass
    return inside


def wrap_in_autocast(
    source: str,
    dtype: str = "bfloat16",
    import_torch: bool = True,
    transform: Transform | None = None,
    parsed: ParsedCell | None = None,
) -> str:
    """``source`` with its body inside ``with torch.autocast("cuda", dtype=torch.<dtype>):``.

    A cell-magic header stays first. Lines are indented by four spaces except lines inside a
    multi-line string (found by tokenizing what IPython would run, so ``!cmd`` lines do not confuse
    it); IPython accepts indented ``!cmd`` and ``%magic`` lines. Raises ``SyntaxError`` when the
    cell does not parse, so a broken cell is never wrapped. ``parsed`` is ``source`` already parsed.
    """
    if dtype not in {"bfloat16", "float16"}:
        raise ValueError(f"autocast dtype must be bfloat16 or float16, got {dtype!r}")
    if parsed is None or parsed.source != source:
        parsed = parse_cell(source, transform)
    raw_lines = split_lines(source)
    header, body = raw_lines[: parsed.header_lines], raw_lines[parsed.header_lines :]
    newline = line_ending(source)
    transformed = "".join(parsed.transformed_lines)
    inside_string = {parsed.line_map[t] for t in _string_continuation_lines(transformed) if t in parsed.line_map}
    wrapped = []
    for number, line in enumerate(body, start=parsed.header_lines + 1):
        if not line.strip() or number in inside_string:
            wrapped.append(line)
        else:
            wrapped.append("    " + line)
    if not any(line.strip() for line in wrapped):
        wrapped.append("    pass" + newline)
    if wrapped and not wrapped[-1].endswith(("\n", "\r")):
        wrapped[-1] += newline
    opening = []
    if import_torch:
        opening.append("import torch" + newline)
    opening.append(f'with torch.autocast("cuda", dtype=torch.{dtype}):' + newline)
    if header and not header[-1].endswith(("\n", "\r")):
        header[-1] += newline
    return "".join(header + opening + wrapped)
