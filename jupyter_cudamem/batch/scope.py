"""Which names a body of code reads from the user's namespace, and which are its own.

A name the failed cell binds before it reads it is the cell's, not the namespace's; a notebook
function's locals are its own, except the parameters a call binds to a namespace path; comprehension and
lambda variables are their own. Every reader asks here before it records a read of the namespace.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping

from ..cell.source import callable_name
from .earlier_cells import path_of
from .knobs import ObjectPath
from .notebook_classes import local_aliases


class Scope:
    """The names of one body (the failed cell, or a notebook function bound to a call's arguments)."""

    def __init__(
        self,
        namespace: Mapping[str, object],
        cell: bool,
        bindings: dict[str, ObjectPath | None],
        local_names: set[str],
    ):
        self.namespace = namespace
        self.cell = cell
        self.bindings = bindings  # a function's parameters: the namespace path the call passed, or None
        self.local_names = local_names
        self.bound_at: dict[str, int] = {}  # cell: first line binding each name
        self.scopes: list[set[str]] = []  # comprehension and lambda variables
        self.loop_targets: set[str] = set()
        self.range_steps: dict[str, str] = {}  # loop variable of ``range(a, b, step)`` -> the step, dumped

    def read_bindings(self, body: list[ast.stmt]) -> None:
        """Before reading ``body``: the cell's bindings, or a function's locals that only rename a path."""
        if self.cell:
            self._collect_bindings(body)
        else:
            for name, value in local_aliases(body):  # ``B, T = self.B, self.T``: B is self.B
                path = self.namespace_path(value)
                if path is not None and name not in self.bindings:
                    self.bindings[name] = path

    def push(self, names: set[str]) -> None:
        """Enter a comprehension, lambda or nested function binding ``names``."""
        self.scopes.append(names)

    def pop(self) -> None:
        self.scopes.pop()

    def is_local(self, name: str, node: ast.AST) -> bool:
        if any(name in scope for scope in self.scopes):
            return True
        if not self.cell:
            return name in self.local_names and self.bindings.get(name) is None
        if self.scopes and name in self.bound_at:
            return True  # read inside a function or lambda the cell defines: the cell's own binding
        line = getattr(node, "lineno", 0)
        return name in self.bound_at and self.bound_at[name] <= line and not self._read_before_bound(name, node)

    def _read_before_bound(self, name: str, node: ast.AST) -> bool:
        # ``x = x + 1`` on the line that binds x reads the namespace's x.
        return self.bound_at.get(name) == getattr(node, "lineno", -1) and name not in self.loop_targets

    def namespace_path(self, node: ast.AST) -> ObjectPath | None:
        """The namespace path an expression reads, if it reads one (through a parameter's binding too)."""
        path = path_of(node)
        if path is None:
            return None
        if any(path.root in scope for scope in self.scopes):
            return None
        if not self.cell and path.root in self.bindings:
            bound = self.bindings[path.root]
            return None if bound is None else ObjectPath(bound.root, bound.steps + path.steps)
        root = node
        while isinstance(root, (ast.Attribute, ast.Subscript)):
            root = root.value
        if self.is_local(path.root, root):
            return None
        if path.root not in self.namespace:
            return None
        return path

    def _collect_bindings(self, body: list[ast.stmt]) -> None:
        for node in ast.walk(ast.Module(body=body, type_ignores=[])):
            names: list[tuple[str, int]] = []
            if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
                names.append((node.id, node.lineno))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.append((node.name, node.lineno))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names += [((a.asname or a.name).split(".")[0], node.lineno) for a in node.names]
            elif isinstance(node, (ast.For, ast.AsyncFor)):
                self.loop_targets.update(n.id for n in ast.walk(node.target) if isinstance(n, ast.Name))
            for name, line in names:
                self.bound_at[name] = min(self.bound_at.get(name, line), line)
        self._forget_comprehension_names(body)

    def _forget_comprehension_names(self, body: list[ast.stmt]) -> None:
        """Names bound inside comprehensions or nested functions do not count: they are scoped there."""
        for node in ast.walk(ast.Module(body=body, type_ignores=[])):
            if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
                for generator in node.generators:
                    for name in (n.id for n in ast.walk(generator.target) if isinstance(n, ast.Name)):
                        if not _bound_outside(body, name, generator.target):
                            self.bound_at.pop(name, None)


def range_step(target: ast.AST, iterable: ast.AST) -> tuple[str, str] | None:
    """``for i in range(0, n, step)``: (``i``, the step dumped), for matching ``x[i:i + step]``."""
    if (
        isinstance(target, ast.Name)
        and isinstance(iterable, ast.Call)
        and callable_name(iterable) == "range"
        and len(iterable.args) == 3
    ):
        return target.id, ast.dump(iterable.args[2])
    return None


def assigned_in(body: list[ast.stmt]) -> set[str]:
    """Names a function body binds (its locals), not looking into nested functions."""
    names: set[str] = set()
    for node in ast.walk(ast.Module(body=body, type_ignores=[])):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def globals_in(body: list[ast.stmt]) -> set[str]:
    return {
        name
        for node in ast.walk(ast.Module(body=body, type_ignores=[]))
        if isinstance(node, ast.Global)
        for name in node.names
    }


def _bound_outside(body: list[ast.stmt], name: str, inside: ast.AST) -> bool:
    for node in ast.walk(ast.Module(body=body, type_ignores=[])):
        if (
            isinstance(node, ast.Name)
            and node.id == name
            and isinstance(node.ctx, ast.Store)
            and not any(node is n for n in ast.walk(inside))
            and not _in_comprehension_target(body, node)
        ):
            return True
    return False


def _in_comprehension_target(body: list[ast.stmt], target: ast.AST) -> bool:
    for node in ast.walk(ast.Module(body=body, type_ignores=[])):
        if isinstance(node, ast.comprehension) and any(target is n for n in ast.walk(node.target)):
            return True
    return False
