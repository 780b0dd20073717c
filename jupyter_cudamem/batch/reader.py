"""Reading one body of code: the failed cell, or a notebook function or method it calls.

A ``BodyReader`` walks the statements of one body and hands each expression to its ``ExpressionReader``
(``expressions``, which hands calls to ``calls``); what names are its own is its ``Scope`` (``scope``),
what the cell writes itself its ``CellNumbers`` (``cell_numbers``). A call into notebook code, or a loop
over an instance of a notebook class, is followed here: a new reader for that function's body, its
parameters bound to what the call passed, all recording into one ``Scan`` (``reads``).
"""

from __future__ import annotations

import ast
import inspect
import types

from ..cell.source import ParsedCell, callable_name, int_constant
from .body import Body
from .cell_numbers import CellNumbers
from .earlier_cells import parameter_defaults, path_of
from .expressions import ExpressionReader
from .knobs import ObjectPath
from .libraries import found, is_user_class, is_user_function, resolve
from .names import batch_like, name_score
from .notebook_classes import ITERATION_METHODS, kept_parameters, methods
from .provenance import History
from .reads import CELL_BONUS, MAX_FUNCTION_DEPTH, USE_SCORES, Scan, Use
from .scope import Scope, assigned_in, globals_in, range_step


class BodyReader:
    """Reads one body of code: the failed cell (``cell=True``) or a notebook function it calls."""

    def __init__(
        self,
        scan: Scan,
        parsed: ParsedCell | None,
        cell: bool,
        bindings: dict[str, ObjectPath | None] | None = None,
        local_names: set[str] | None = None,
        function_name: str | None = None,
        depth: int = 0,
    ):
        self.parsed = parsed
        scope = Scope(scan.namespace, cell, bindings or {}, local_names or set())
        self.body = Body(scan, scope, CellNumbers(parsed), cell, self, function_name, depth)
        self.expressions = ExpressionReader(self.body)

    def read_body(self, body: list[ast.stmt]) -> None:
        self.body.scope.read_bindings(body)
        for statement in body:
            self._statement(statement)

    # -- statements -----------------------------------------------------------------------------------
    def _statement(self, node: ast.stmt) -> None:
        if isinstance(node, ast.Assign):
            self._assignment(node.targets, node.value)
        elif isinstance(node, ast.AnnAssign):
            if node.value is not None:
                self._assignment([node.target], node.value)
        elif isinstance(node, ast.AugAssign):
            self.expressions.expr(node.target, Use.OTHER)
            self.expressions.expr(node.value, Use.OTHER)
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            self.expressions.expr(node.iter, Use.ITERATED)
            stepped = range_step(node.target, node.iter)
            if stepped:
                self.body.scope.range_steps[stepped[0]] = stepped[1]
            for statement in node.body + node.orelse:
                self._statement(statement)
            if stepped:
                self.body.scope.range_steps.pop(stepped[0], None)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                context = item.context_expr
                name = callable_name(context) if isinstance(context, ast.Call) else ""
                if name in ("no_grad", "inference_mode"):
                    self.body.scan.evaluates = True
                self.expressions.expr(context, Use.OTHER)
            for statement in node.body:
                self._statement(statement)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            self._function_definition(node)
        elif isinstance(node, ast.ClassDef):
            self._class_definition(node)
        elif isinstance(node, (ast.Expr, ast.Return)):
            if node.value is not None:
                self.expressions.expr(node.value, Use.OTHER)
        elif isinstance(node, ast.Assert):
            self.expressions.expr(node.test, Use.PRINTED)
        elif isinstance(
            node, (ast.Import, ast.ImportFrom, ast.Global, ast.Nonlocal, ast.Pass, ast.Break, ast.Continue)
        ):
            return
        else:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    self._statement(child)
                elif isinstance(child, ast.expr):
                    self.expressions.expr(child, Use.OTHER)
                elif isinstance(child, ast.ExceptHandler):
                    for statement in child.body:
                        self._statement(statement)

    def _assignment(self, targets: list[ast.expr], value: ast.expr) -> None:
        for target in targets:
            self._target(target, value)
        single = targets[0] if len(targets) == 1 else None
        self.body.assigning = single.id if isinstance(single, ast.Name) else None
        try:
            self.expressions.expr(value, Use.OTHER)
        finally:
            self.body.assigning = None
        for target in targets:
            if isinstance(target, (ast.Attribute, ast.Subscript)):
                self.expressions.expr(target.value, Use.OTHER)

    def _target(self, target: ast.expr, value: ast.expr) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts):
                for sub_target, sub_value in zip(target.elts, value.elts):
                    self._target(sub_target, sub_value)
            return
        literal = int_constant(value)
        if not self.body.cell or literal is None:
            return
        if isinstance(target, ast.Name):
            self.body.numbers.assigned.setdefault(target.id, []).append(value)
        elif isinstance(target, (ast.Attribute, ast.Subscript)):
            path = path_of(target)
            if path is not None and path.steps and batch_like(path.last_name):
                self.body.numbers.add("assignment", path.text, value, name_score(path.last_name) + CELL_BONUS)

    def _function_definition(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        """A function defined in the failed cell: its defaults are the cell's numbers, its body the cell's code."""
        if not self.body.cell:
            return
        self.body.functions_defined[node.name] = node
        for default in node.args.defaults + [d for d in node.args.kw_defaults if d is not None]:
            self.expressions.expr(default, Use.OTHER)
        parameters = {a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs}
        self.body.scope.push(parameters | assigned_in(node.body))
        for statement in node.body:
            self._statement(statement)
        self.body.scope.pop()
        for argument, default in parameter_defaults(node):
            parameter = argument.arg
            value = int_constant(default)
            if value is None:
                continue
            uses = _uses_in(node.body, parameter)
            evidence_score = max((USE_SCORES.get(u, 0) for u in uses), default=0)
            if batch_like(parameter) or evidence_score:
                self.body.numbers.add(
                    "default",
                    parameter,
                    default,
                    name_score(parameter) + evidence_score + CELL_BONUS,
                    tuple(u.value for u in uses if u in USE_SCORES),
                )

    def _class_definition(self, node: ast.ClassDef) -> None:
        for item in node.body:
            if self.body.cell and isinstance(item, (ast.Assign, ast.AnnAssign)):
                targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                for target in targets:
                    if isinstance(target, ast.Name) and batch_like(target.id) and item.value is not None:
                        self.body.numbers.add(
                            "assignment",
                            f"{node.name}.{target.id}",
                            item.value,
                            name_score(target.id) + CELL_BONUS,
                        )
            elif isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self._function_definition(item)

    # -- notebook code the body calls -----------------------------------------------------------------
    def follow_call(self, node: ast.Call, callee: object) -> None:
        """Read a notebook function (or a method of a notebook class) the code calls, with its parameters
        bound to the namespace paths the call passes."""
        self_path: ObjectPath | None = None
        function = callee
        if inspect.ismethod(callee) and is_user_class(type(callee.__self__)):
            receiver = node.func.value if isinstance(node.func, ast.Attribute) else None
            self_path = None if receiver is None else self.body.scope.namespace_path(receiver)
            function = callee.__func__
        if not is_user_function(function):
            return
        defined = _definition_of(self.body.scan.history, function)
        if defined is None:
            return
        _, parsed, definition = defined
        called = _bind_call(node, callee, function, self_path)
        if called is None:
            return
        signature, bound = called
        parameters = list(signature.parameters)
        bindings: dict[str, ObjectPath | None] = dict.fromkeys(parameters)
        if inspect.ismethod(callee) and parameters:
            bindings[parameters[0]] = self_path
        for parameter, argument in bound.arguments.items():
            if isinstance(argument, ast.AST):
                bindings[parameter] = self.body.scope.namespace_path(argument)
        key = (id(definition), tuple(sorted((k, v) for k, v in bindings.items() if v is not None)))
        if key in self.body.scan.analysed:
            return
        self.body.scan.analysed.add(key)
        reader = BodyReader(
            self.body.scan,
            parsed,
            cell=False,
            bindings=bindings,
            local_names=set(parameters) | assigned_in(definition.body) - globals_in(definition.body),
            function_name=function.__name__,
            depth=self.body.depth + 1,
        )
        reader.read_body(definition.body)
        if self_path is None:
            self._note_defaults(node, signature, bound, definition)

    def _note_defaults(
        self, node: ast.Call, signature: inspect.Signature, bound: inspect.BoundArguments,
        definition: ast.FunctionDef | ast.AsyncFunctionDef,
    ) -> None:
        """The batch-like integer defaults of a notebook function the call leaves unset: knobs of their own."""
        function_path = self.body.scope.namespace_path(node.func)
        if function_path is None:
            return
        for declared in signature.parameters.values():
            default = declared.default
            if declared.name in bound.arguments or type(default) is not int or default < 2:
                continue
            uses = _uses_in(definition.body, declared.name)
            if batch_like(declared.name) or any(u in USE_SCORES for u in uses):
                self.body.scan.defaults.append((function_path, declared.name, default, uses))

    def follow_iteration(self, iterable: ast.expr, path: ObjectPath) -> None:
        """``for xb, yb in train_dl`` over an instance of a notebook class: read its ``__iter__``."""
        if self.body.depth >= MAX_FUNCTION_DEPTH:
            return
        value = resolve(self.body.scan.namespace, path)
        if not found(value) or not is_user_class(type(value)):
            return
        for method_name in ITERATION_METHODS:
            method = getattr(value, method_name, None)
            if inspect.ismethod(method):
                receiver = ast.Attribute(value=iterable, attr=method_name, ctx=ast.Load())
                self.follow_call(ast.Call(func=receiver, args=[], keywords=[]), method)

    def kept_uses(self, cls: type) -> dict[str, Use]:
        """A notebook class's constructor parameters that its methods use as a batch, each with its best use."""
        defined = self.body.scan.history.cells.definition(cls.__name__)
        if defined is None or not isinstance(defined[2], ast.ClassDef):
            return {}
        return _class_batch_parameters(defined[2])


def _bind_call(
    node: ast.Call, callee: object, function: types.FunctionType, self_path: ObjectPath | None
) -> tuple[inspect.Signature, inspect.BoundArguments] | None:
    """The function's signature and the call's arguments bound to it (a method's first parameter to
    ``None``); ``None`` where the call unpacks ``*args``/``**kwargs`` or does not fit the signature."""
    try:
        signature = inspect.signature(function)
        arguments: list[ast.expr | None] = ([None] if self_path is not None or inspect.ismethod(callee) else []) + list(node.args)
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            return None
        return signature, signature.bind_partial(*arguments, **{k.arg: k.value for k in node.keywords if k.arg})
    except (TypeError, ValueError):
        return None


def _definition_of(
    history: History, function: types.FunctionType
) -> tuple[int, ParsedCell, ast.FunctionDef | ast.AsyncFunctionDef] | None:
    """Where a notebook function or method was defined in the input history, found by its qualified name."""
    qualified = getattr(function, "__qualname__", function.__name__).split(".")
    defined = history.cells.definition(qualified[0])
    if defined is None:
        return None
    number, parsed, node = defined
    for part in qualified[1:]:
        if part == "<locals>":
            return None
        node = next(
            (
                i
                for i in getattr(node, "body", [])
                if isinstance(i, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and i.name == part
            ),
            None,
        )  # type: ignore[assignment]
        if node is None:
            return None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    return number, parsed, node


def _uses_in(body: list[ast.stmt], name: str) -> set[Use]:
    """How a function body uses one of its parameters."""
    scan = Scan({name: None}, History([], 0, {}), None)
    probe = BodyReader(
        scan, None, cell=False, bindings={name: ObjectPath(name)}, local_names={name}, depth=MAX_FUNCTION_DEPTH
    )
    probe.read_body(body)
    read = scan.reads.get(ObjectPath(name))
    if read is None:
        return set()
    return set(read.uses) | ({Use.DIMENSION} if 0 in read.dims else set())


def _class_batch_parameters(definition: ast.ClassDef) -> dict[str, Use]:
    """Constructor parameters a notebook class keeps (``self.B = B``) and uses as a batch in a method
    (``.view(B, T)`` through ``B = self.B``, ``range(0, n, self.bs)``), each with its strongest use."""
    kept = kept_parameters(definition)
    if not kept:
        return {}
    attribute_uses: dict[str, set[Use]] = {}
    for method in methods(definition):
        arguments = method.args.posonlyargs + method.args.args
        if not arguments:
            continue
        self_name = arguments[0].arg
        scan = Scan({self_name: None}, History([], 0, {}), None)
        probe = BodyReader(
            scan,
            None,
            cell=False,
            bindings={self_name: ObjectPath(self_name)},
            local_names={a.arg for a in arguments} | assigned_in(method.body),
            depth=MAX_FUNCTION_DEPTH,
        )
        probe.read_body(method.body)
        for path, read in scan.reads.items():
            if path.root == self_name and len(path.steps) == 1 and not path.steps[0].key:
                uses = set(read.uses) | ({Use.DIMENSION} if 0 in read.dims else set())
                attribute_uses.setdefault(str(path.steps[0].name), set()).update(uses)
    batch_parameters = {}
    for parameter, attributes in kept.items():
        uses = {u for attribute in attributes for u in attribute_uses.get(attribute, set()) if u in USE_SCORES}
        if uses:
            batch_parameters[parameter] = max(uses, key=lambda u: (USE_SCORES[u], u.value))
    return batch_parameters
