"""The failed cell read once, into what every part of ``%oomfix`` needs of it (``ReadCell``).

The restorer, the driver, the set-aside and the tries each need the names the cell binds before reading
them and the names it reads; the strategies and the advice need its traits. Read here, once, and handed
down. A try's source differs from the failed cell only where the batch is (a number, a chunk size) or by an
autocast ``with`` around its statements, neither of which changes what it binds before reading: the failed
cell's names stand for every try's, and no try's source is parsed for them.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from .source import ParsedCell, Transform, default_transform, parse_cell
from .traits import CellTraits, traits_of


@dataclass(frozen=True)
class ReadCell:
    """A cell's source read as IPython runs it (``transform``): its tree (``parsed`` is ``None`` when what
    IPython runs does not parse), the names its body binds before any statement reads them
    (``binds_first``, in order of binding), the names it reads (``reads``, in order), and its traits."""

    source: str
    transform: Transform
    parsed: ParsedCell | None
    traits: CellTraits
    binds_first: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()

    @property
    def rebinds(self) -> tuple[str, ...]:
        """What a rerun binds again in the namespace: ``binds_first``, but none under a cell magic
        (``%%time``), whose body runs as one call of it."""
        return () if self.parsed is not None and self.parsed.header_lines else self.binds_first


def read_cell(source: str, transform: Transform | None = None) -> ReadCell:
    """``source`` read once (``parse_cell``, with IPython's transform by default)."""
    transform = transform or default_transform
    try:
        parsed = parse_cell(source, transform)
    except Exception:  # noqa: BLE001  SyntaxError, or IPython's transformer on odd input: the text is all we have
        return ReadCell(source, transform, None, traits_of(source, None))
    tree = parsed.tree
    return ReadCell(source, transform, parsed, traits_of(source, tree), tuple(names_bound_before_read(tree)),
                    tuple(names_read(tree)))


def names_read(tree: ast.AST) -> list[str]:
    """Every name the cell reads, once, in the order they appear (inside the functions it defines too:
    their globals)."""
    found = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)]
    found += [n.target for n in ast.walk(tree) if isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name)]
    found.sort(key=lambda n: (n.lineno, n.col_offset))
    return list(dict.fromkeys(n.id for n in found))


def names_bound_before_read(tree: ast.Module) -> list[str]:
    """Names the cell (``tree``, its body as IPython runs it) binds before any statement reads them, in
    order of binding.

    A name read before it is bound (``x = x.cuda()``, ``h += 1``) or bound only inside a function or a
    class is not listed: a rerun needs its old value. Names bound inside a loop, a branch or a ``try``
    (a training loop's ``logits``, ``loss``) are listed when nothing after that statement reads them:
    whether or not the body runs, the old value is never read again. Seen on an H100 with an LSTM whose
    loop bound 1 GiB of ``logits`` (``benchmarks/oomfix.py``): left bound, each try started with the
    last one's.
    """
    read: set[str] = set()
    bound: list[str] = []
    top = _in_order(tree.body, read)
    loads_after: list[set[str]] = [set() for _ in top]  # names read by the top-level statements after each
    later: set[str] = set()
    for index in range(len(top) - 1, -1, -1):
        loads_after[index] = set(later)
        later |= _loads(top[index])
    for index, statement in enumerate(top):
        if isinstance(statement, _BLOCKS):
            inner: list[str] = []
            _walk_block(statement, read, inner)
            bound += [name for name in inner if name not in loads_after[index] and name not in bound]
            continue
        _bind(statement, read, bound)
    return bound


_BLOCKS: tuple[type[ast.stmt], ...] = (ast.For, ast.AsyncFor, ast.While, ast.If, ast.Try, ast.TryStar,
                                       ast.With, ast.AsyncWith)


def _loads(node: ast.AST) -> set[str]:
    names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    names |= {n.target.id for n in ast.walk(node) if isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name)}
    return names


def _bind(statement: ast.stmt, read: set[str], bound: list[str]) -> None:
    """One simple statement: what it reads is read first, then what it binds is bound."""
    stores: list[str] = []
    targets: list[ast.AST] = []
    if isinstance(statement, ast.Assign):
        targets = list(statement.targets)
    elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
        targets = [statement.target]
    for target in targets:
        stores += [n.id for n in ast.walk(target) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
    read |= _loads(statement)
    for name in stores:
        if name not in read and name not in bound:
            bound.append(name)


def _walk_block(statement: ast.stmt, read: set[str], bound: list[str]) -> None:
    """A compound statement in the order it runs: its header's reads, its target, then its bodies."""
    for body in _header(statement, read, bound):
        for inner in body:
            if isinstance(inner, _BLOCKS):
                _walk_block(inner, read, bound)
            elif isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                read |= _loads(inner)
            else:
                _bind(inner, read, bound)


def _header(statement: ast.stmt, read: set[str], bound: list[str]) -> list[list[ast.stmt]]:
    """A compound statement's header: what it reads into ``read``, its loop target into ``bound``; its
    bodies in the order they run (none for a statement that is not a block)."""
    if isinstance(statement, (ast.For, ast.AsyncFor)):
        read |= _loads(statement.iter)
        for name in (n.id for n in ast.walk(statement.target) if isinstance(n, ast.Name)):
            if name not in read and name not in bound:
                bound.append(name)
        bodies = [statement.body, statement.orelse]
    elif isinstance(statement, (ast.While, ast.If)):
        read |= _loads(statement.test)
        bodies = [statement.body, statement.orelse]
    elif isinstance(statement, (ast.With, ast.AsyncWith)):
        for item in statement.items:
            read |= _loads(item.context_expr)
        bodies = [statement.body]
    elif isinstance(statement, (ast.Try, ast.TryStar)):
        bodies = [statement.body] + [h.body for h in statement.handlers] + [statement.orelse, statement.finalbody]
    else:
        return []
    return bodies


def _in_order(body: list[ast.stmt], read: set[str]) -> list[ast.stmt]:
    """The statements that always run, in order: a ``with`` block's body counts as the cell's own
    (``%oomfix`` wraps a cell in ``with torch.autocast(...)``); what its header reads is read first."""
    statements: list[ast.stmt] = []
    for statement in body:
        if isinstance(statement, ast.With):
            for item in statement.items:
                read |= {n.id for n in ast.walk(item) if isinstance(n, ast.Name)}
            statements += _in_order(statement.body, read)
        else:
            statements.append(statement)
    return statements
