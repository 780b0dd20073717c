"""Run a cell body inside a magic the way IPython runs a cell.

Like ``%%time``: IPython syntax is transformed (``!cmd``, ``%magic``), AST transformers apply, the
code is compiled under the cell's cached name so tracebacks show its lines, and the last expression
is evaluated separately so its value can be displayed. Exceptions propagate unchanged.
"""

from __future__ import annotations

import ast
from typing import Any

from .base import current_cell_number

NO_VALUE = object()

# Characters that start IPython syntax (magics, shell escapes, help). A cell without any of them that
# parses as Python is left alone by IPython's token transforms, so we can skip their cost (~150 µs).
_IPYTHON_SYNTAX = ("%", "!", "?")


def _transform(shell: Any, raw_cell: str) -> str:
    if not shell.input_transformers_post and not any(mark in raw_cell for mark in _IPYTHON_SYNTAX):
        try:
            ast.parse(raw_cell)
        except SyntaxError:
            pass  # maybe indented or prompt-prefixed input: IPython's transforms fix those
        else:
            return raw_cell
    return shell.transform_cell(raw_cell)


def run_cell_body(shell: Any, raw_cell: str) -> Any:
    """Execute ``raw_cell`` in the user namespace; return the last expression's value or ``NO_VALUE``."""
    __tracebackhide__ = True  # noqa: F841 - hides this frame in IPython tracebacks
    transformed = _transform(shell, raw_cell)
    filename = shell.compile.cache(transformed, current_cell_number(shell) or 0, raw_code=raw_cell)
    tree = shell.compile.ast_parse(transformed, filename=filename)
    tree = shell.transform_ast(tree)
    last_expression = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last_expression = ast.Expression(tree.body.pop().value)
    namespace = shell.user_ns
    if tree.body:
        exec(shell.compile(tree, filename, "exec"), namespace)
    if last_expression is None:
        return NO_VALUE
    value = eval(shell.compile(last_expression, filename, "eval"), namespace)
    if raw_cell.rstrip().endswith(";"):
        return NO_VALUE
    return value
