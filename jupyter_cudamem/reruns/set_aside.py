"""A failed try leaves nothing: what the failed cell bound is set aside before the reruns, and nothing of a
failed try stays alive on our side.

**Before the first rerun.** The failed cell may have bound values before it failed that it will bind
again (its input ``x = torch.randn(batch, ...)``): left bound, the rerun builds the new one while the
old one still holds its memory. Seen on an H100 with a GRU started at batch 8192: the failed cell's
1 GiB input was still allocated when the first try began, and a try at a batch that needs 1.2 GiB
failed. ``set_aside`` finds the names the cell binds *before reading them* (so the rerun cannot need
the old value) whose value holds GPU memory, moves tensors and modules to the host and unbinds the
names. If every try fails, ``give_back`` binds them again, moved back where they were; if a try fits,
the rerun has bound new values and the set-aside ones are dropped.

**After each failed try.** The driver keeps of a try only its figures and a one-line message (never the
exception: its traceback holds the frames of the forward or backward that failed, with their
activations), and ``restore_bindings`` puts the namespace back as it was before the try, IPython's
output-cache names (``_``, ``__``, ``___``) included. The cleanup the driver is given then releases what
IPython keeps of the failure.

Knows nothing of IPython: it works on a namespace (a mutable mapping) and the cell's source. Moving to
the host is a ``Mover`` (``sources.torch_host.TorchMover`` for PyTorch; tests pass fakes).
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..cell.source import parse_cell
from ..ipython_names import OUTPUT_CACHE_NAMES, is_ipython_name


def _kept_as_the_try_left(name: str) -> bool:
    """IPython's own names (``ipython_names``: the cleanup's business) and private names: what a failed
    try bound to them is not undone, except the output cache's ``_``, ``__``, ``___``."""
    return name not in OUTPUT_CACHE_NAMES and (name.startswith("_") or is_ipython_name(name))


class Mover(Protocol):
    """How values holding GPU memory are recognised and moved to the host and back."""

    def holds_gpu(self, value: object) -> bool: ...

    def to_host(self, value: object) -> tuple[object, Callable[[], object]] | None:
        """``(host value, give back)`` where ``give back()`` returns the value on its device again;
        ``None`` when this value cannot be moved (it is then left bound)."""
        ...

    def addresses(self, value: object) -> frozenset[int]:
        """Where on the device the memory ``value`` holds starts (each tensor's storage)."""
        ...

    def grown(self, value: object, from_batch: int, to_batch: int) -> list[list[Any]]:
        """Memory held beside ``value``'s tensors of ``from_batch`` rows so they hold what they would at
        ``to_batch``, each block in a list that lets it go when cleared, and with its tensor."""
        ...


def bound_before_read(source: str, transform: Callable[[str], str] | None = None) -> list[str]:
    """Names the cell binds before any statement reads them, in order of binding.

    A name read before it is bound (``x = x.cuda()``, ``h += 1``) or bound only inside a function or a
    class is not listed: the rerun needs its old value. Names bound inside a loop, a branch or a
    ``try`` (a training loop's ``logits``, ``loss``) are listed when nothing after that statement reads
    them: whether or not the body runs, the old value is never read again. Seen on an H100 with an LSTM
    whose loop bound 1 GiB of ``logits`` (``benchmarks/oomfix.py``): left bound, each try started with
    the last one's.

    ``source`` is read as IPython runs it (``parse_cell``, with ``transform``; IPython's own by default).
    A cell under a cell magic (``%%time``) runs as one call of it: it binds no name of its own.
    """
    try:
        parsed = parse_cell(source, transform)
    except Exception:  # noqa: BLE001  SyntaxError, or IPython's transformer on odd input
        return []
    return [] if parsed.header_lines else names_bound_before_read(parsed.tree)


def names_bound_before_read(tree: ast.Module) -> list[str]:
    """``bound_before_read``'s names read from ``tree``, a cell's body as IPython runs it."""
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


@dataclass
class SetAside:
    """What ``set_aside`` took out of the namespace: ``give_back()`` if no try fits, ``drop()`` if one did."""

    namespace: MutableMapping[str, Any]
    entries: dict[str, tuple[object, Callable[[], object]]] = field(default_factory=dict)
    kept: tuple[str, ...] = ()  # names holding GPU memory that could not be moved (left bound)
    freed_bytes: int = 0  # what setting them aside freed, where the caller measured it
    left_on_host: list[str] = field(default_factory=list)  # given back as their host copies (``give_back``)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.entries)

    def give_back(self) -> list[str]:
        """Bind each set-aside name again, moved back to its device (names a try bound since are left alone).

        A value that does not fit on its device again (what the reruns left there took its room) is bound
        as its host copy, which holds the same data, and named in ``left_on_host``: never lost."""
        given = []
        for name, (host, back) in self.entries.items():
            if name not in self.namespace:
                try:
                    self.namespace[name] = back()
                except Exception:  # noqa: BLE001  out of memory on the way back: the host copy is the data
                    self.namespace[name] = host
                    self.left_on_host.append(name)
                given.append(name)
        self.entries.clear()
        return given

    def drop(self) -> None:
        self.entries.clear()

    def drop_rebound(self) -> None:
        """Forget the names a try that fitted bound anew; the others (bound in a loop or branch the try
        did not run) stay set aside, to be given back when the fix ends."""
        for name in [n for n in self.entries if n in self.namespace]:
            del self.entries[name]

    def merge(self, other: SetAside) -> None:
        """Keep ``other``'s entries too (the first value set aside under a name wins: it is the oldest)."""
        for name, entry in other.entries.items():
            self.entries.setdefault(name, entry)
        self.freed_bytes += other.freed_bytes


def set_aside(
    namespace: MutableMapping[str, Any],
    source: str,
    mover: Mover,
    transform: Callable[[str], str] | None = None,
) -> SetAside:
    """Move to the host and unbind what the failed cell bound and will bind again (see the module docstring)."""
    aside = SetAside(namespace)
    kept = []
    for name in bound_before_read(source, transform):
        if name.startswith("_") or is_ipython_name(name) or name not in namespace:
            continue
        value = namespace[name]
        try:
            if not mover.holds_gpu(value):
                continue
            moved = mover.to_host(value)
        except Exception:
            moved = None
        if moved is None:
            kept.append(name)
            continue
        aside.entries[name] = moved
        del namespace[name]
        del value
    aside.kept = tuple(kept)
    return aside


def restore_bindings(namespace: MutableMapping[str, Any], before: Mapping[str, Any]) -> list[str]:
    """Put ``namespace`` back as it was in ``before``: names the run bound anew are removed, rebound
    names get their old object back. Returns the names changed.

    A try that fails half-way leaves what it already assigned: a ``loss`` whose ``backward()`` ran out
    of memory keeps its whole autograd graph (every saved activation) alive, which then shrinks the room
    for the next try. The output cache's ``_``, ``__``, ``___`` are put back too (a try that displayed a
    tensor before failing would otherwise keep it); ``In``/``Out`` are IPython's cleanup's business.
    """
    changed = []
    for name in list(namespace):
        if _kept_as_the_try_left(name):
            continue
        if name not in before:
            del namespace[name]
            changed.append(name)
        elif namespace[name] is not before[name]:
            namespace[name] = before[name]
            changed.append(name)
    for name, value in before.items():
        if name not in namespace and (not name.startswith("_") or name in OUTPUT_CACHE_NAMES):
            namespace[name] = value
            changed.append(name)
    return changed
