"""What a class the notebook defines keeps from its constructor, and the locals that stand for it.

A notebook's own loader (``DataLoaderLite(B=16, T=1024)``, a ``Batcher(data, bs)``) keeps the batch
as an attribute (``self.B = B``) and uses it in a method, often through a local
(``B, T = self.B, self.T`` then ``.view(B, T)``). The finder reads method bodies with the instance
bound to where it lives; these helpers give it the two facts that reading needs, from the class's
source alone: which constructor parameter each attribute holds, and which locals of a body are
only another name for a path (so a use of the local is a use of the path). Pure ``ast``: nothing
runs and nothing is imported.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

# A method the finder follows when the cell uses an instance without calling a method by name:
# ``for xb, yb in train_dl`` runs ``__iter__``.
ITERATION_METHODS = ("__iter__",)


def methods(definition: ast.ClassDef) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for item in definition.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield item


def kept_parameters(definition: ast.ClassDef) -> dict[str, list[str]]:
    """Constructor parameter -> the attributes ``__init__`` stores it in (``self.B = B``,
    ``self.ds, self.bs = ds, bs``). Only plain stores of the parameter itself count."""
    init = next((m for m in methods(definition) if m.name == "__init__"), None)
    if init is None or not (init.args.posonlyargs or init.args.args):
        return {}
    positional = init.args.posonlyargs + init.args.args
    self_name = positional[0].arg
    parameters = {a.arg for a in positional[1:] + init.args.kwonlyargs}
    kept: dict[str, list[str]] = {}
    for statement in ast.walk(ast.Module(body=init.body, type_ignores=[])):
        if not isinstance(statement, ast.Assign):
            continue
        for target in statement.targets:
            for stored, value in _pairs(target, statement.value):
                if (
                    isinstance(stored, ast.Attribute)
                    and isinstance(stored.value, ast.Name)
                    and stored.value.id == self_name
                    and isinstance(value, ast.Name)
                    and value.id in parameters
                ):
                    kept.setdefault(value.id, []).append(stored.attr)
    return kept


def local_aliases(body: list[ast.stmt]) -> list[tuple[str, ast.expr]]:
    """Locals a body binds exactly once, to a name or an attribute/item path (``B = self.B``,
    ``B, T = self.B, self.T``), in the order they are bound: a use of one is a use of that path.
    A local bound again anywhere (a loop, ``+=``, a second assignment) is its own value, not an alias."""
    stores: dict[str, int] = {}
    aliases: list[tuple[str, ast.expr]] = []
    for node in _walk_body(body):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            stores[node.id] = stores.get(node.id, 0) + 1
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            for target, value in _pairs(node.targets[0], node.value):
                if isinstance(target, ast.Name) and _is_path(value):
                    aliases.append((target.id, value))
    return [(name, value) for name, value in aliases if stores.get(name) == 1]


def _pairs(target: ast.expr, value: ast.expr) -> Iterator[tuple[ast.expr, ast.expr]]:
    """Each target with the expression it gets: ``a, b = x, y`` gives (a, x) and (b, y)."""
    if isinstance(target, (ast.Tuple, ast.List)):
        if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts):
            for sub_target, sub_value in zip(target.elts, value.elts):
                yield from _pairs(sub_target, sub_value)
        return
    yield target, value


def _is_path(node: ast.expr) -> bool:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Subscript) and not (
            isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, (str, int))
        ):
            return False
        node = node.value
    return isinstance(node, ast.Name)


def _walk_body(body: list[ast.stmt]) -> Iterator[ast.AST]:
    """Every node of a body, not looking into nested functions, classes or lambdas (their own scopes)."""
    stack: list[ast.AST] = list(reversed(body))
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(node))))
