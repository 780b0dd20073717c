"""The cells before the failed one, read: which expression a statement gives a path, where a name was bound.

Reading is kept apart from tracing (``provenance``): everything here answers "which expression, in
which ``In[k]``, sets this?" and hands back the expression; ``provenance.History`` follows it to a number.
Nothing runs and nothing here looks at the namespace. ``path_of`` (the path an expression names, such as
``config["batch_size"]``) lives here too: the finder's readers name what they read with it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Sequence

from ..cell.source import ParsedCell, Transform, parse_cell
from .knobs import ObjectPath, Step

# Where a cell sets something: the cell's number, the cell parsed, the expression or definition found.
Found = tuple[int, ParsedCell, ast.expr]


class EarlierCells:
    """The cells before the failed one (``cells[k]`` is ``In[k]``), each parsed once, on demand."""

    def __init__(self, cells: Sequence[str] | None, before: int | None, transform: Transform | None = None):
        self.cells = list(cells or [])
        self.before = len(self.cells) if before is None else min(before, len(self.cells))
        self.transform = transform
        self._parsed: dict[int, ParsedCell | None] = {}

    def parsed(self, number: int) -> ParsedCell | None:
        if number not in self._parsed:
            try:
                self._parsed[number] = parse_cell(str(self.cells[number]), self.transform)
            except Exception:  # a cell that does not parse (it failed when it ran) sets nothing we can read
                self._parsed[number] = None
        return self._parsed[number]

    def numbers(self) -> range:
        """Cell numbers from the latest before the failed cell back to ``In[1]``."""
        return range(self.before - 1, 0, -1)

    def source(self, number: int) -> str:
        return str(self.cells[number])

    def _latest_first(self) -> Iterator[tuple[int, ParsedCell]]:
        for number in self.numbers():
            parsed = self.parsed(number)
            if parsed is not None:
                yield number, parsed

    def definition(
        self, name: str
    ) -> tuple[int, ParsedCell, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef] | None:
        """The latest ``def name`` or ``class name`` at the top level of a cell."""
        for number, parsed in self._latest_first():
            for statement in reversed(list(statements(parsed.tree.body))):
                if (
                    isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                    and statement.name == name
                ):
                    return number, parsed, statement
        return None

    def assignment(self, name: str) -> Found | None:
        """The expression the latest statement binding ``name`` gave it (``x, y = a, b`` gives ``a`` for
        ``x``); ``None`` when the name was last bound otherwise (a loop, an unpacked call) or never."""
        path = ObjectPath(name)
        for number, parsed in self._latest_first():
            for statement in reversed(list(statements(parsed.tree.body))):
                if isinstance(statement, (ast.Assign, ast.AnnAssign)) and statement.value is not None:
                    targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
                    for target in targets:
                        match = match_target(target, statement.value, path)
                        if match is not None:
                            expression, rest, index = match
                            return (number, parsed, expression) if not rest and index is None else None
                elif name in assigned_names(statement):
                    return None
        return None

    def string_literal(self, name: str) -> tuple[int, ParsedCell, ast.Constant] | None:
        """The string literal (YAML text, say) the latest ``name = ...`` gave ``name``, if it gave one."""
        for number, parsed in self._latest_first():
            for statement in reversed(list(statements(parsed.tree.body))):
                if isinstance(statement, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == name for t in statement.targets
                ):
                    node = statement.value
                    if isinstance(node, ast.Constant) and isinstance(node.value, str):
                        return number, parsed, node
                    return None
        return None

    def option_default(self, options: list[str]) -> Found | None:
        """The default an ``argparse`` option was given: ``add_argument("--bs", default=64)`` or
        ``set_defaults(bs=64)``, in the latest cell that gives one."""
        for number, parsed in self._latest_first():
            for node in ast.walk(parsed.tree):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                    continue
                if node.func.attr == "add_argument" and any(
                    isinstance(a, ast.Constant) and a.value in options for a in node.args
                ):
                    default = next((k.value for k in node.keywords if k.arg == "default"), None)
                    if default is not None:
                        return number, parsed, default
                if node.func.attr == "set_defaults":
                    default = next(
                        (k.value for k in node.keywords if k.arg in {o.lstrip("-").replace("-", "_") for o in options}),
                        None,
                    )
                    if default is not None:
                        return number, parsed, default
        return None


# -- statements and what they bind ------------------------------------------------------------------------
def statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements in run order, into ``if``/``for``/``with``/``try`` blocks but not into definitions."""
    for statement in body:
        yield statement
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for name in ("body", "orelse", "finalbody"):
            yield from statements(getattr(statement, name, []) or [])
        for handler in getattr(statement, "handlers", []) or []:
            yield from statements(handler.body)


def path_of(node: ast.AST) -> ObjectPath | None:
    """``config["a"].b`` as a path from the name ``config``; ``None`` for anything else."""
    steps: list[Step] = []
    while True:
        if isinstance(node, ast.Attribute):
            steps.append(Step(node.attr))
            node = node.value
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.slice, ast.Constant)
            and isinstance(node.slice.value, (str, int))
            and not isinstance(node.slice.value, bool)
        ):
            steps.append(Step(node.slice.value, key=True))
            node = node.value
        elif isinstance(node, ast.Name):
            return ObjectPath(node.id, tuple(reversed(steps)))
        else:
            return None


def is_prefix(prefix: ObjectPath, path: ObjectPath) -> bool:
    return (
        prefix.root == path.root
        and len(prefix.steps) < len(path.steps)
        and path.steps[: len(prefix.steps)] == prefix.steps
    )


def match_target(
    target: ast.AST, expression: ast.expr, path: ObjectPath
) -> tuple[ast.expr, tuple[Step, ...], int | None] | None:
    """When assigning ``expression`` to ``target`` sets ``path`` or an object on its way: what sets it,
    the steps left from there, and which item of what it returns when the target unpacks a call's result."""
    if isinstance(target, (ast.Tuple, ast.List)):
        if isinstance(expression, (ast.Tuple, ast.List)) and len(expression.elts) == len(target.elts):
            for sub_target, sub_value in zip(target.elts, expression.elts):
                match = match_target(sub_target, sub_value, path)
                if match is not None:
                    return match
            return None
        # ``train_loader, val_loader = make_loaders(batch_size=64)``: the call sets each of them.
        for index, element in enumerate(target.elts):
            if isinstance(element, ast.Name) and element.id == path.root:
                return expression, path.steps, index
        return None
    bound = path_of(target)
    if bound is None:
        return None
    if bound == path:
        return expression, (), None
    if is_prefix(bound, path):
        return expression, path.steps[len(bound.steps) :], None
    return None


def update_argument(call: ast.Call, path: ObjectPath) -> tuple[ast.expr, tuple[Step, ...]] | None:
    """``config.update(batch_size=64)`` / ``config.update({"batch_size": 64})`` on an object on the path:
    what it sets there, and the steps left from that expression."""
    if not (isinstance(call.func, ast.Attribute) and call.func.attr == "update"):
        return None
    receiver = path_of(call.func.value)
    if receiver is None or not (receiver == path or is_prefix(receiver, path)) or receiver == path:
        return None
    rest = path.steps[len(receiver.steps) :]
    for keyword in call.keywords:
        if keyword.arg == rest[0].name:
            return keyword.value, rest[1:]
    if call.args and isinstance(call.args[0], ast.Dict) and dict_value(call.args[0], rest[0].name) is not None:
        return call.args[0], rest
    return None


def class_attribute(statement: ast.ClassDef, steps: tuple[Step, ...]) -> tuple[ast.expr, tuple[Step, ...]] | None:
    """``class Config: batch_size = 64``, or ``__init__``'s default for it: the expression, and the steps left."""
    name = steps[0].name
    for item in reversed(statement.body):
        if isinstance(item, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in item.targets):
            return item.value, steps[1:]
        if (
            isinstance(item, ast.AnnAssign)
            and isinstance(item.target, ast.Name)
            and item.target.id == name
            and item.value
        ):
            return item.value, steps[1:]
    init = next((i for i in statement.body if isinstance(i, ast.FunctionDef) and i.name == "__init__"), None)
    if init is not None and len(steps) == 1:
        default = parameter_default(init, str(name))
        if default is not None:
            return default, ()
    return None


def definition_default(node: ast.AST, name: str) -> ast.expr | None:
    """What a notebook function's parameter defaults to, or a notebook class's field (a dataclass field, a
    class attribute, or ``__init__``'s default)."""
    if isinstance(node, ast.ClassDef):
        for item in node.body:
            if (
                isinstance(item, ast.AnnAssign)
                and isinstance(item.target, ast.Name)
                and item.target.id == name
                and item.value is not None
            ):
                return item.value  # a dataclass field
            if isinstance(item, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in item.targets):
                return item.value
        init = next((i for i in node.body if isinstance(i, ast.FunctionDef) and i.name == "__init__"), None)
        if init is None:
            return None
        node = init
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return parameter_default(node, name)
    return None


def returned_expression(definition: ast.FunctionDef | ast.AsyncFunctionDef, index: int | None) -> ast.expr | None:
    """What a notebook function returns last (item ``index`` of it when the caller unpacks it), through
    the local it returns to that local's last assignment."""
    returns = [n for n in ast.walk(definition) if isinstance(n, ast.Return) and n.value is not None]
    if not returns:
        return None
    returned: ast.expr = returns[-1].value  # type: ignore[assignment]
    if index is not None:
        if not (isinstance(returned, (ast.Tuple, ast.List)) and index < len(returned.elts)):
            return None
        returned = returned.elts[index]
    if isinstance(returned, ast.Name):  # a local of the function: its last assignment there
        assigned = None
        for statement in statements(definition.body):
            if isinstance(statement, ast.Assign):
                for target in statement.targets:
                    match = match_target(target, statement.value, ObjectPath(returned.id))
                    if match is not None and match[2] is None:
                        assigned = match[0]
        if assigned is not None:
            returned = assigned
    return returned


def assigned_names(statement: ast.stmt) -> set[str]:
    """Names a statement binds other than by ``=`` (a loop, ``with ... as``, an import, a definition); ``+=``
    keeps the object (and a tensor its shape), so it is not one."""
    if isinstance(statement, (ast.For, ast.AsyncFor, ast.With, ast.AsyncWith, ast.Import, ast.ImportFrom)):
        return bound_names(statement)
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {statement.name}
    return set()


def bound_names(statement: ast.stmt) -> set[str]:
    names: set[str] = set()
    if isinstance(statement, (ast.For, ast.AsyncFor)):
        targets = [statement.target]
    elif isinstance(statement, (ast.With, ast.AsyncWith)):
        targets = [item.optional_vars for item in statement.items if item.optional_vars is not None]
    else:
        for alias in statement.names:  # type: ignore[attr-defined]
            names.add((alias.asname or alias.name).split(".")[0])
        return names
    for target in targets:
        names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def dict_value(node: ast.Dict, key: str | int) -> ast.expr | None:
    for dict_key, value in zip(node.keys, node.values):
        if isinstance(dict_key, ast.Constant) and dict_key.value == key:
            return value
    return None


def parameter_defaults(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[tuple[ast.arg, ast.expr]]:
    args = function.args
    positional = args.posonlyargs + args.args
    pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults))
    return pairs + [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]


def parameter_default(function: ast.FunctionDef | ast.AsyncFunctionDef, name: str) -> ast.expr | None:
    args = function.args
    positional = args.posonlyargs + args.args
    for arg, default in zip(positional[len(positional) - len(args.defaults) :], args.defaults):
        if arg.arg == name:
            return default
    for arg, kw_default in zip(args.kwonlyargs, args.kw_defaults):
        if arg.arg == name and kw_default is not None:
            return kw_default
    return None


# -- describing a place -----------------------------------------------------------------------------------
def where(number: int, parsed: ParsedCell, node: ast.AST) -> str:
    line = parsed.raw_line(node)
    return f"In[{number}]" + (f" line {line}" if line else "")


def code(parsed: ParsedCell, node: ast.AST) -> str:
    line = parsed.raw_line(node)
    text = parsed.line_text(line).strip() if line else ""
    return text if len(text) <= 80 else text[:79] + "…"
