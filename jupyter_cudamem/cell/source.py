"""A cell's code as IPython runs it, with every number's place in the text the user typed.

A cell is IPython input, not Python: it may start with a cell magic (``%%time``) and hold ``!cmd`` or
``%magic`` lines. We parse what IPython would run (its own input transformer), and map each line of
that back to the raw line it came from when the transformer left it unchanged. Edits then go to the
*raw* text at the AST positions of what they change, so comments, spacing and IPython syntax survive
byte for byte, which ``ast.unparse`` of the whole cell could not promise.

A cell is parsed once: ``parse_cell`` is memoised, so every reader of one source (``read.read_cell``,
the batch finder, the autocast wrapper) calls it and gets the same ``ParsedCell``.
"""

from __future__ import annotations

import ast
import difflib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType

Transform = Callable[[str], str]


@dataclass(frozen=True)
class Span:
    """Where a piece of code sits in a cell's raw text: 1-based line, 0-based character columns, one line."""

    line: int
    col: int
    end_col: int


def default_transform(source: str) -> str:
    """IPython input to Python, as the shell's ``transform_cell`` does (plain Python without IPython)."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager
    except ImportError:  # plain Python without IPython: the cell is Python
        return source
    return TransformerManager().transform_cell(source)


def split_lines(text: str) -> list[str]:
    """Lines with their endings, split where Python's tokenizer splits (not at form feeds)."""
    return re.findall(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z", text)


def line_ending(source: str) -> str:
    return "\r\n" if "\r\n" in source else "\n"


def _cell_magic_header_lines(lines: list[str]) -> int:
    """How many leading lines are cell-magic headers (``%%time``), whose body is Python again."""
    index = 0
    while index < len(lines) and not lines[index].strip():
        index += 1
    start = index
    while index < len(lines) and lines[index].lstrip().startswith("%%"):
        index += 1
    return index if index > start else 0


def _char_col(line_text: str, byte_col: int) -> int:
    """AST columns count UTF-8 bytes; edits need characters."""
    return len(line_text.encode("utf-8")[:byte_col].decode("utf-8", errors="ignore"))


@dataclass(frozen=True)
class ParsedCell:
    """The AST of what IPython runs for ``source``, and the way back to ``source``'s own lines.

    One object is shared by every reader of the source (``parse_cell`` is memoised): read it, never
    change it. A reader that would rewrite the tree works on ``copy.deepcopy(parsed.tree)``.
    """

    source: str
    tree: ast.Module
    transformed_lines: tuple[str, ...]
    line_map: Mapping[int, int]  # transformed 1-based line -> raw 1-based line, for unchanged lines only
    header_lines: int  # cell-magic header lines before the Python body

    @property
    def body_line(self) -> int:
        """The first raw line after any cell-magic header."""
        return self.header_lines + 1

    def raw_line(self, node: ast.AST) -> int | None:
        """The raw line a node starts on, when IPython left that line as typed."""
        return self.line_map.get(getattr(node, "lineno", 0))

    def span(self, node: ast.AST) -> Span | None:
        """Where a one-line node sits in the raw text; ``None`` for a node IPython rewrote or that spans lines."""
        lineno = getattr(node, "lineno", None)
        raw_line = self.line_map.get(lineno or 0)
        if lineno is None or raw_line is None or getattr(node, "end_lineno", None) != lineno:
            return None
        text = self.transformed_lines[lineno - 1]
        start, end = node.col_offset, node.end_col_offset  # type: ignore[attr-defined]
        return Span(raw_line, _char_col(text, start), _char_col(text, end))

    def end_span(self, node: ast.AST) -> Span | None:
        """An empty span just after ``node`` (where text can be inserted), when that line is as typed."""
        end_lineno = getattr(node, "end_lineno", None)
        raw_line = self.line_map.get(end_lineno or 0)
        if end_lineno is None or raw_line is None:
            return None
        col = _char_col(self.transformed_lines[end_lineno - 1], node.end_col_offset)  # type: ignore[attr-defined]
        return Span(raw_line, col, col)

    def text(self, span: Span) -> str:
        return split_lines(self.source)[span.line - 1][span.col : span.end_col]

    def line_text(self, raw_line: int) -> str:
        lines = split_lines(self.source)
        return lines[raw_line - 1].rstrip("\r\n") if 0 < raw_line <= len(lines) else ""


def parse_cell(source: str, transform: Transform | None = None) -> ParsedCell:
    """Parse ``source`` as IPython input. Raises ``SyntaxError`` when what IPython would run does not parse.

    Memoised on ``(source, transform)`` (``_parse``): a source read again with the same transform is not
    parsed again. ``None`` is IPython's own transform, so both spellings share one entry.
    """
    transform = transform or default_transform
    try:
        hash(transform)
    except TypeError:  # a callable object that defines equality but no hash: parsed each time
        return _parse.__wrapped__(source, transform)
    return _parse(source, transform)


# Keyed on the transform itself, held by the cache, not on its id: the shell's ``transform_cell`` is a
# new bound method at each attribute access, and bound methods of one object and one function are equal
# and hash alike, so they share an entry; a new closure each time is a new key (a miss, never a wrong
# hit), and an id freed and reused by another transform could not be mistaken for it. A source that does
# not parse is not cached (its ``SyntaxError`` is raised again each time). The bound keeps at most a few
# fixes' worth of cells (the failed cell, each try, the earlier cells the finder reads).
@lru_cache(maxsize=128)
def _parse(source: str, transform: Transform) -> ParsedCell:
    raw_lines = split_lines(source)
    header = _cell_magic_header_lines(raw_lines)
    body = "".join(raw_lines[header:])
    transformed = transform(body)
    tree = ast.parse(transformed)
    new_lines = split_lines(transformed)
    old_lines = raw_lines[header:]
    matcher = difflib.SequenceMatcher(
        a=[line.rstrip("\r\n") for line in old_lines], b=[line.rstrip("\r\n") for line in new_lines], autojunk=False
    )
    line_map: dict[int, int] = {}
    for tag, a0, a1, b0, _ in matcher.get_opcodes():
        if tag == "equal":
            for offset in range(a1 - a0):
                line_map[b0 + offset + 1] = header + a0 + offset + 1
    return ParsedCell(source, tree, tuple(new_lines), MappingProxyType(line_map), header)


# -- small readers of AST nodes that every cell reader needs ---------------------------------------
def int_constant(node: ast.AST | None) -> int | None:
    """The value of an integer literal (not a bool), else ``None``."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    return None


def callable_name(call: ast.Call) -> str:
    """The last name of what is called: ``DataLoader`` for ``torch.utils.data.DataLoader(...)``."""
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return ""


def dotted_name(node: ast.AST) -> str | None:
    """``torch.utils.data.DataLoader`` for that chain of attributes on a name, else ``None``."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))
