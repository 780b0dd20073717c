"""Settings written inside text: a YAML, JSON or ``key=value`` string, and an ``argparse`` argument list.

The number to rewrite then sits inside a string literal, not in Python: finding its digits there is
its own job, kept out of the tracing (``provenance``), which calls these when a trace reaches a string.
"""

from __future__ import annotations

import ast
import re

from ..cell.source import ParsedCell, Span, split_lines
from .earlier_cells import code, where
from .knobs import Step, Trace, Written


def in_text(node: ast.Constant, steps: tuple[Step, ...], value: int, number: int, parsed: ParsedCell) -> Trace:
    """A setting inside a string literal: YAML, JSON or ``key=value`` (``batch_size: 64``)."""
    place = where(number, parsed, node)
    key = str(steps[-1].name) if steps else ""
    first = parsed.raw_line(node)
    last = parsed.line_map.get(getattr(node, "end_lineno", 0) or 0)
    if not key or first is None or last is None:
        return Trace((), place)
    lines = split_lines(parsed.source)
    # YAML (``batch_size: 64``), JSON (``"batch_size": 64``) and ``key=value`` text alike.
    pattern = re.compile(rf"(?<![\w-]){re.escape(key)}[\"']?\s*[:=]\s*(\d+)\b")
    hits = []
    for line in range(first, last + 1):
        for match in pattern.finditer(lines[line - 1]):
            if int(match.group(1)) == value:
                hits.append(Span(line, match.start(1), match.end(1)))
    if len(hits) == 1:
        return Trace((Written(number, hits[0]),), f"In[{number}] line {hits[0].line}")
    return Trace((), place)


def option_strings(parser: object, dest: str) -> list[str]:
    """The command-line options of a parser that set ``dest`` (``--batch-size``), or the usual spellings."""
    options = [o for a in getattr(parser, "_actions", []) if getattr(a, "dest", None) == dest for o in a.option_strings]
    return options or [f"--{dest}", f"--{dest.replace('_', '-')}"]


def given_option(call: ast.Call, options: list[str], value: int, number: int, parsed: ParsedCell) -> Trace | None:
    """``parser.parse_args(["--batch-size", "64"])`` or ``parse_args("--batch-size 64".split())``: where the
    option is given in the call; ``None`` when the call does not give it (its default then sets it)."""
    place = where(number, parsed, call)
    given = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "args"), None)
    if isinstance(given, (ast.List, ast.Tuple)):
        return _given_in_list(given.elts, options, value, number, parsed, place)
    if isinstance(given, ast.Call) and isinstance(given.func, ast.Attribute) and given.func.attr == "split":
        return _given_in_split(given.func.value, options, value, number, parsed, place)
    return None


def _given_in_list(
    items: list[ast.expr], options: list[str], value: int, number: int, parsed: ParsedCell, place: str
) -> Trace | None:
    """``["--batch-size", "64"]`` or ``["--batch-size=64"]``: where the first of ``options`` given is."""
    for index, item in enumerate(items):
        if not (isinstance(item, ast.Constant) and isinstance(item.value, str)):
            continue
        option, _, attached = item.value.partition("=")
        if option not in options:
            continue
        target = item if attached else (items[index + 1] if index + 1 < len(items) else None)
        text = attached or (
            target.value if isinstance(target, ast.Constant) and isinstance(target.value, str) else ""
        )
        if text.strip().isdigit() and target is not None:
            span = digits_span(parsed, target, text.strip())
            if span is not None and int(text) == value:
                return Trace((Written(number, span),), place)
        return Trace((), f"{place} ({code(parsed, item)})")
    return None


def _given_in_split(
    text_node: ast.expr, options: list[str], value: int, number: int, parsed: ParsedCell, place: str
) -> Trace | None:
    """``"--batch-size 64".split()``: where one of ``options`` is given ``value`` in the string."""
    if not (isinstance(text_node, ast.Constant) and isinstance(text_node.value, str)):
        return None
    for option in options:
        match = re.search(rf"(?:^|\s){re.escape(option)}[\s=]+(\d+)\b", text_node.value)
        if match and int(match.group(1)) == value:
            span = digits_span(parsed, text_node, match.group(1), option)
            if span is not None:
                return Trace((Written(number, span),), place)
    return None


def digits_span(parsed: ParsedCell, node: ast.AST, digits: str, after: str | None = None) -> Span | None:
    """Where ``digits`` sit inside the raw text of a one-line string literal (after ``after``, if given)."""
    span = parsed.span(node)
    if span is None:
        return None
    text = parsed.text(span)
    start = text.find(after) + len(after) if after and after in text else 0
    match = re.compile(rf"(?<!\d){re.escape(digits)}(?!\d)").search(text, start)
    if match is None:
        return None
    return Span(span.line, span.col + match.start(), span.col + match.end())

