"""Where a value in the user's namespace was written: the ``In[k]`` line, found through IPython's input history.

Given a path (``batch_size``, ``config["batch_size"]``, ``trainer.args.per_device_train_batch_size``)
and its value now, walk the history from the latest cell back: the last statement that bound the
path, or an object on its way, tells what expression set it. Follow that expression: a number is the
answer; a name or another path is traced in turn (and recorded in ``via``: it holds the same batch
and must change too); a call is read through its keywords, through the live callee's signature for
positional arguments, through a dict or YAML text it was given, through ``argparse``'s own record of
its options, or down to the default of a notebook-defined function or class.

Nothing runs: the history is parsed, and the namespace only read (a callee's signature, a parser's
options). A trace that does not end at a number still says where the value came from, in words.
This module follows expressions; which expression a cell gives a path is read by ``earlier_cells``,
and a number written inside a string by ``text_settings``.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..cell.source import ParsedCell, Transform, dotted_name, int_constant
from .earlier_cells import (
    EarlierCells,
    bound_names,
    class_attribute,
    code,
    definition_default,
    dict_value,
    is_prefix,
    match_target,
    parameter_defaults,
    path_of,
    returned_expression,
    statements,
    update_argument,
    where,
)
from .knobs import ObjectPath, Step, Trace, Written
from .libraries import found, resolve
from .text_settings import digits_span, given_option, in_text, option_strings

_MAX_DEPTH = 8  # names traced through names: a chain longer than this is a cycle or not worth following


class History:
    """The tracing of values through the cells before the failed one (``cells``, read by ``EarlierCells``)."""

    def __init__(
        self,
        cells: Sequence[str] | None,
        before: int | None,
        namespace: Mapping[str, object] | None,
        transform: Transform | None = None,
    ):
        self.cells = EarlierCells(cells, before, transform)
        self.namespace: Mapping[str, object] = namespace or {}
        self._unpacked: int | None = None  # the item of a call's result the traced statement unpacked
        self._statement_at: tuple[int, ast.stmt] | None = None  # the statement being traced, and its cell
        # While tracing through a notebook function's body: its parameters, bound to the call's arguments.
        self._parameters: dict[str, tuple[ast.expr, int, ParsedCell]] = {}

    def follow(self, path: ObjectPath, value: int) -> Trace:
        """Where another path holding ``value`` was set, with that path among the places that change."""
        return self._follow(path, value, 0)

    def default_of(self, function_name: str, parameter: str, value: int) -> Trace | None:
        """Where a notebook function's parameter default is written."""
        defined = self.cells.definition(function_name)
        return None if defined is None else self._default_in_definition(defined, parameter, value)

    # -- statements -----------------------------------------------------------------------------------
    def trace(
        self, path: ObjectPath, value: int, depth: int = 0, before: tuple[int, ast.stmt] | None = None
    ) -> Trace | None:
        """Where ``path`` (whose value is ``value`` now) was set, or ``None`` when no cell shows it; with
        ``before`` (a cell and one of its statements), only where it was set before that statement ran."""
        if depth > _MAX_DEPTH:
            return None
        for number in self.cells.numbers():
            if before is not None and number > before[0]:
                continue
            parsed = self.cells.parsed(number)
            if parsed is None:
                continue
            in_order = list(statements(parsed.tree.body))
            if before is not None and number == before[0]:
                in_order = in_order[: next((i for i, s in enumerate(in_order) if s is before[1]), 0)]
            for statement in reversed(in_order):
                outer, self._statement_at = self._statement_at, (number, statement)
                try:
                    result = self._statement(statement, path, value, number, parsed, depth)
                finally:
                    self._statement_at = outer
                if result is not None:
                    return result if number in result.through else replace(result, through=(number,) + result.through)
        return None

    def _statement(
        self, statement: ast.stmt, path: ObjectPath, value: int, number: int, parsed: ParsedCell, depth: int
    ) -> Trace | None:
        if isinstance(statement, (ast.Assign, ast.AnnAssign)):
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            if statement.value is None:
                return None
            for target in targets:
                match = match_target(target, statement.value, path)
                if match is not None:
                    expression, rest, index = match
                    self._unpacked = index if isinstance(expression, ast.Call) else None
                    return self._resolve(expression, rest, value, number, parsed, depth)
        elif isinstance(statement, ast.AugAssign):
            augmented = path_of(statement.target)
            if augmented == path or (augmented is not None and is_prefix(augmented, path)):
                return Trace((), f"{where(number, parsed, statement)} (computed: {code(parsed, statement)})")
        elif isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call):
            updated = update_argument(statement.value, path)
            return None if updated is None else self._resolve(*updated, value, number, parsed, depth)
        elif isinstance(statement, ast.ClassDef) and statement.name == path.root and path.steps:
            attribute = class_attribute(statement, path.steps)
            return None if attribute is None else self._resolve(*attribute, value, number, parsed, depth)
        elif isinstance(statement, (ast.For, ast.AsyncFor, ast.With, ast.AsyncWith, ast.Import, ast.ImportFrom)) and (
            path.root in bound_names(statement)
        ):
            return Trace((), f"{where(number, parsed, statement)} ({code(parsed, statement)})")
        return None

    # -- expressions ---------------------------------------------------------------------------------
    def _resolve(
        self, expression: ast.expr, steps: tuple[Step, ...], value: int, number: int, parsed: ParsedCell, depth: int
    ) -> Trace | None:
        place = where(number, parsed, expression)
        if isinstance(expression, ast.Name) and expression.id in self._parameters:
            argument, caller, caller_parsed = self._parameters.pop(expression.id)
            return self._resolve(argument, steps, value, caller, caller_parsed, depth)
        if not steps:
            return self._number(expression, value, number, parsed, depth)
        if isinstance(expression, ast.DictComp) and steps[0].key:
            return self._resolve(
                expression.value, steps[1:], value, number, parsed, depth
            )  # {x: DataLoader(...) for x in ...}
        if isinstance(expression, ast.ListComp) and steps[0].key and isinstance(steps[0].name, int):
            return self._resolve(expression.elt, steps[1:], value, number, parsed, depth)
        if isinstance(expression, ast.Dict):
            inner = dict_value(expression, steps[0].name)
            if inner is None:
                return Trace((), f"{place} ({code(parsed, expression)}, without {steps[0].name!r})")
            return self._resolve(inner, steps[1:], value, number, parsed, depth)
        call = _called(expression)
        if call is not None:
            return self._through_call(call, steps, value, number, parsed, depth)
        inner_path = path_of(expression)
        if inner_path is not None:
            return self._follow(ObjectPath(inner_path.root, inner_path.steps + steps), value, depth)
        if isinstance(expression, ast.Constant) and isinstance(expression.value, str):
            return in_text(expression, steps, value, number, parsed)
        return Trace((), f"{place} ({code(parsed, expression)})")

    def _follow(self, path: ObjectPath, value: int, depth: int) -> Trace:
        """Trace another path the value came from; it holds the same value now, so it changes too."""
        inner = self.trace(path, value, depth + 1)
        holds = resolve(self.namespace, path)
        via = (path,) if found(holds) and type(holds) is int and holds == value else ()
        if inner is None:
            return Trace((), f"from {path.text}", via)
        return Trace(inner.written, inner.origin, via + inner.via, inner.through)

    def _number(self, expression: ast.expr, value: int, number: int, parsed: ParsedCell, depth: int) -> Trace | None:
        place = where(number, parsed, expression)
        literal = int_constant(expression)
        if literal is not None:
            span = parsed.span(expression)
            if literal != value:
                return Trace((), f"{place} wrote {literal}; it is {value} now")
            return Trace((Written(number, span),) if span else (), place)
        if (
            isinstance(expression, ast.Constant)
            and isinstance(expression.value, str)
            and expression.value.strip().isdigit()
        ):
            digits = digits_span(parsed, expression, expression.value.strip())
            return Trace((Written(number, digits),) if digits and int(expression.value) == value else (), place)
        if isinstance(expression, ast.Name) and expression.id in self._parameters:
            argument, caller, caller_parsed = self._parameters.pop(expression.id)
            return self._number(argument, value, caller, caller_parsed, depth)
        inner_path = path_of(expression)
        if inner_path is not None:
            return self._follow(inner_path, value, depth)
        if _constant_arithmetic(expression) and parsed.span(expression) is not None:
            span = parsed.span(expression)
            assert span is not None
            return Trace((Written(number, span),), f"{place} (computed: {code(parsed, expression)})")
        return Trace((), f"{place} (computed: {code(parsed, expression)})")

    # -- calls ----------------------------------------------------------------------------------------
    def _through_call(
        self, call: ast.Call, steps: tuple[Step, ...], value: int, number: int, parsed: ParsedCell, depth: int
    ) -> Trace | None:
        name = str(steps[0].name)
        place = where(number, parsed, call)
        unpacked, self._unpacked = self._unpacked, None
        for keyword in call.keywords:
            if keyword.arg == name:
                return self._resolve(keyword.value, steps[1:], value, number, parsed, depth)
        function = call.func
        if isinstance(function, ast.Attribute) and function.attr in ("parse_args", "parse_known_args"):
            return self._argparse(call, name, value, number, parsed)
        if name == "hparams" and len(steps) > 1:  # Lightning's save_hyperparameters keeps __init__'s arguments
            return self._through_call(call, steps[1:], value, number, parsed, depth)
        if call.args and isinstance(call.args[0], ast.Dict) and dict_value(call.args[0], name) is not None:
            return self._resolve(call.args[0], steps, value, number, parsed, depth)  # OmegaConf.create({...})
        if call.args and isinstance(call.args[0], (ast.Constant, ast.Name)):
            text = call.args[0]
            if isinstance(text, ast.Name):
                literal = self.cells.string_literal(text.id)
                if literal is not None:
                    text_number, text_parsed, text_node = literal
                    return in_text(text_node, steps, value, text_number, text_parsed)
            elif isinstance(text.value, str):
                found_in_text = in_text(text, steps, value, number, parsed)
                if found_in_text.written:
                    return found_in_text
        callee_path = path_of(function)
        callee = resolve(self.namespace, callee_path) if callee_path is not None else None
        partial_of = path_of(call.args[0]) if callee is functools.partial and call.args else None
        if partial_of is not None:
            # ``partial(DataLoader, ds, 128)``: the arguments after the function are the function's own.
            callee = resolve(self.namespace, partial_of)
            call = ast.Call(func=call.args[0], args=call.args[1:], keywords=call.keywords)
        argument = _bound_argument(callee, call, name)
        if argument is not None:
            return self._resolve(argument, steps[1:], value, number, parsed, depth)
        passed = _passed_through(call, self.namespace, unpacked)
        if passed is not None and self._statement_at is not None:
            # ``model, opt, loader = accelerator.prepare(model, opt, loader)``: the loader as it was before.
            passed_path = path_of(passed)
            if passed_path is not None:
                before = self.trace(ObjectPath(passed_path.root, passed_path.steps + steps), value, depth + 1,
                                    before=self._statement_at)
                if before is not None:
                    return before
        returned = self._through_return(call, callee, steps, value, number, parsed, depth, unpacked)
        if returned is not None:
            return returned
        # Not passed: the callee's default, written where the callee was defined (a notebook class or
        # function), or else the library's default, which a keyword added to this call overrides.
        if len(steps) == 1 and isinstance(function, ast.Name | ast.Attribute):
            defined = self.cells.definition(function.attr if isinstance(function, ast.Attribute) else function.id)
            if defined is not None:
                traced = self._default_in_definition(defined, name, value)
                if traced is not None:
                    return traced
            if _accepts(callee, name):
                last = (
                    (call.keywords[-1].value if call.keywords else call.args[-1])
                    if (call.args or call.keywords)
                    else None
                )
                insert_at = parsed.end_span(last) if last is not None else None
                callee_name = dotted_name(function) or "the callee"
                if insert_at is not None:
                    return Trace(
                        (Written(number, insert_at, insert=f", {name}={{}}"),),
                        f"{place} (not given: the default of {callee_name})",
                    )
                return Trace((), f"{place} (not given: the default of {callee_name})")
        return Trace((), f"{place} ({code(parsed, call)})")

    def _through_return(
        self,
        call: ast.Call,
        callee: object,
        steps: tuple[Step, ...],
        value: int,
        number: int,
        parsed: ParsedCell,
        depth: int,
        index: int | None,
    ) -> Trace | None:
        """``train_loader, val_loader = make_loaders(df)``: what a notebook function returns, traced into its body,
        its parameters bound to the call's arguments."""
        if not (inspect.isfunction(callee) and getattr(callee, "__module__", None) == "__main__"):
            return None
        defined = self.cells.definition(callee.__name__)
        if defined is None or not isinstance(defined[2], (ast.FunctionDef, ast.AsyncFunctionDef)):
            return None
        function_number, function_parsed, definition = defined
        assert isinstance(definition, (ast.FunctionDef, ast.AsyncFunctionDef))
        returned = returned_expression(definition, index)
        if returned is None:
            return None
        try:
            bound = inspect.signature(callee).bind_partial(
                *call.args, **{k.arg: k.value for k in call.keywords if k.arg}
            )
        except (TypeError, ValueError):
            bound = None
        saved = self._parameters
        self._parameters = {a.arg: (d, function_number, function_parsed) for a, d in parameter_defaults(definition)}
        self._parameters.update(
            {
                name: (argument, number, parsed)
                for name, argument in (bound.arguments.items() if bound else [])
                if isinstance(argument, ast.expr)
            }
        )
        try:
            return self._resolve(returned, steps, value, function_number, function_parsed, depth + 1)
        finally:
            self._parameters = saved

    def _default_in_definition(self, defined: tuple[int, ParsedCell, ast.AST], name: str, value: int) -> Trace | None:
        number, parsed, node = defined
        default = definition_default(node, name)
        return None if default is None else self._number(default, value, number, parsed, 0)

    def _argparse(self, call: ast.Call, dest: str, value: int, number: int, parsed: ParsedCell) -> Trace:
        """``parser.parse_args(["--batch-size", "64"])``, or the option's default where it was added."""
        parser_path = path_of(call.func.value) if isinstance(call.func, ast.Attribute) else None
        parser = resolve(self.namespace, parser_path) if parser_path is not None else None
        options = option_strings(parser, dest)
        given = given_option(call, options, value, number, parsed)
        if given is not None:
            return given
        default = self.cells.option_default(options)
        traced = self._number(default[2], value, default[0], default[1], 0) if default is not None else None
        return traced or Trace((), f"{where(number, parsed, call)} (the parser's default)")


# -- the live callee --------------------------------------------------------------------------------------
def _bound_argument(callee: object, call: ast.Call, name: str) -> ast.expr | None:
    """The argument expression of ``call`` that the live callee takes as parameter ``name``."""
    if callee is None or not callable(callee) or any(isinstance(a, ast.Starred) for a in call.args):
        return None
    try:
        signature = inspect.signature(callee)
    except (TypeError, ValueError):
        if dataclasses.is_dataclass(callee):
            names = [f.name for f in dataclasses.fields(callee)]
            return call.args[names.index(name)] if name in names and names.index(name) < len(call.args) else None
        return None
    parameters = [p for p in signature.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for index, parameter in enumerate(parameters):
        if parameter.name == name and index < len(call.args):
            return call.args[index]
    return None


# Methods that hand back what they are given, prepared for the device: ``Accelerator.prepare`` and
# Lightning Fabric's ``setup_dataloaders`` (one result per argument, in order).
_PASS_THROUGH = {"Accelerator": ("prepare",), "Fabric": ("setup_dataloaders",)}


def _passed_through(call: ast.Call, namespace: Mapping[str, object], unpacked: int | None) -> ast.expr | None:
    """The argument of a pass-through call that the traced target got back (``unpacked``: its position)."""
    if not isinstance(call.func, ast.Attribute) or any(isinstance(a, ast.Starred) for a in call.args):
        return None
    receiver = path_of(call.func.value)
    value = resolve(namespace, receiver) if receiver is not None else None
    if receiver is None or not found(value):
        return None
    names = {cls.__name__ for cls in type(value).__mro__}
    if not any(call.func.attr in methods for name, methods in _PASS_THROUGH.items() if name in names):
        return None
    index = unpacked or 0
    return call.args[index] if index < len(call.args) else None


def _accepts(callee: Any, name: str) -> bool:
    try:
        return name in inspect.signature(callee).parameters
    except (TypeError, ValueError):
        return False


def _constant_arithmetic(node: ast.AST) -> bool:
    """``2 ** 8``, ``64 * 4``: arithmetic of numbers only, which a number can stand in for."""
    if isinstance(node, ast.BinOp):
        return _constant_arithmetic(node.left) and _constant_arithmetic(node.right)
    if isinstance(node, ast.UnaryOp):
        return _constant_arithmetic(node.operand)
    return int_constant(node) is not None


def _called(expression: ast.expr) -> ast.Call | None:
    """The call an expression is, or takes an item of (``parser.parse_known_args()[0]``)."""
    if isinstance(expression, ast.Subscript):
        expression = expression.value
    return expression if isinstance(expression, ast.Call) else None
