"""One body of code being read (the failed cell, or a notebook function it calls): what the body's readers
share (``reader``, ``expressions``, ``calls``), passed down to each instead of each copying it.

``Follower`` is what the body's reader does for notebook code met inside it (a call, a loop over a notebook
class's instance), so the expression and call readers below it need not know that reader.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Protocol

from .cell_numbers import CellNumbers
from .knobs import ObjectPath
from .reads import Scan, Use
from .scope import Scope


class Follower(Protocol):
    """Reads notebook code a body reaches into, recording into the same ``Scan``."""

    def follow_call(self, node: ast.Call, callee: object) -> None: ...

    def follow_iteration(self, iterable: ast.expr, path: ObjectPath) -> None: ...

    def kept_uses(self, cls: type) -> dict[str, Use]: ...


class Expressions(Protocol):
    """The walk over one expression, as the call reader hands arguments back to it."""

    def expr(self, node: ast.AST | None, use: Use, dim: int | None = None) -> None: ...

    def record(self, node: ast.AST, use: Use, dim: int | None = None, method: str | None = None) -> bool: ...


@dataclass
class Body:
    """What one body's readers share: the finding's ``Scan``, the body's ``Scope`` and ``CellNumbers``,
    whether it is the failed cell, and where it is in the reading (``assigning``: the name the statement
    being read assigns, ``h0 = torch.zeros(...)``)."""

    scan: Scan
    scope: Scope
    numbers: CellNumbers
    cell: bool
    follower: Follower
    function_name: str | None = None
    depth: int = 0
    functions_defined: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = field(default_factory=dict)
    assigning: str | None = None
