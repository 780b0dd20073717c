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
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..cell.source import ParsedCell, Span, Transform, dotted_name, int_constant, parse_cell, split_lines
from .knobs import ObjectPath, Step, Written
from .libraries import found, resolve

_MAX_DEPTH = 8  # names traced through names: a chain longer than this is a cycle or not worth following


@dataclass(frozen=True)
class Trace:
    """Where a value was set: the numbers to rewrite (maybe none), in words, and what it passed through."""

    written: tuple[Written, ...]
    origin: str
    via: tuple[ObjectPath, ...] = ()  # namespace paths on the way that hold the same value


def _statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements in run order, into ``if``/``for``/``with``/``try`` blocks but not into definitions."""
    for statement in body:
        yield statement
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for name in ("body", "orelse", "finalbody"):
            yield from _statements(getattr(statement, name, []) or [])
        for handler in getattr(statement, "handlers", []) or []:
            yield from _statements(handler.body)


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


class History:
    """The cells before the failed one, parsed on demand, and the tracing of values through them."""

    def __init__(
        self,
        cells: Sequence[str] | None,
        before: int | None,
        namespace: Mapping[str, Any] | None,
        transform: Transform | None = None,
    ):
        self.cells = list(cells or [])
        self.before = len(self.cells) if before is None else min(before, len(self.cells))
        self.namespace: Mapping[str, Any] = namespace or {}
        self.transform = transform
        self._parsed: dict[int, ParsedCell | None] = {}
        self._unpacked: int | None = None  # the item of a call's result the traced statement unpacked
        self._statement_at: tuple[int, ast.stmt] | None = None  # the statement being traced, and its cell
        # While tracing through a notebook function's body: its parameters, bound to the call's arguments.
        self._parameters: dict[str, tuple[ast.expr, int, ParsedCell]] = {}

    # -- cells ----------------------------------------------------------------------------------------
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

    def definition(
        self, name: str
    ) -> tuple[int, ParsedCell, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef] | None:
        """The latest ``def name`` or ``class name`` at the top level of a cell."""
        for number in self.numbers():
            parsed = self.parsed(number)
            if parsed is None:
                continue
            for statement in reversed(list(_statements(parsed.tree.body))):
                if (
                    isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                    and statement.name == name
                ):
                    return number, parsed, statement
        return None

    def assignment(self, name: str) -> tuple[int, ParsedCell, ast.expr] | None:
        """The expression the latest statement binding ``name`` gave it (``x, y = a, b`` gives ``a`` for
        ``x``); ``None`` when the name was last bound otherwise (a loop, an unpacked call) or never."""
        path = ObjectPath(name)
        for number in self.numbers():
            parsed = self.parsed(number)
            if parsed is None:
                continue
            for statement in reversed(list(_statements(parsed.tree.body))):
                if isinstance(statement, (ast.Assign, ast.AnnAssign)) and statement.value is not None:
                    targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
                    for target in targets:
                        match = self._match_target(target, statement.value, path)
                        if match is not None:
                            expression, rest, index = match
                            return (number, parsed, expression) if not rest and index is None else None
                elif name in _assigned_names(statement):
                    return None
        return None

    def follow(self, path: ObjectPath, value: int) -> Trace:
        """Where another path holding ``value`` was set, with that path among the places that change."""
        return self._follow(path, value, 0)

    # -- tracing --------------------------------------------------------------------------------------
    def trace(
        self, path: ObjectPath, value: int, depth: int = 0, before: tuple[int, ast.stmt] | None = None
    ) -> Trace | None:
        """Where ``path`` (whose value is ``value`` now) was set, or ``None`` when no cell shows it; with
        ``before`` (a cell and one of its statements), only where it was set before that statement ran."""
        if depth > _MAX_DEPTH:
            return None
        for number in self.numbers():
            if before is not None and number > before[0]:
                continue
            parsed = self.parsed(number)
            if parsed is None:
                continue
            statements = list(_statements(parsed.tree.body))
            if before is not None and number == before[0]:
                statements = statements[: next((i for i, s in enumerate(statements) if s is before[1]), 0)]
            for statement in reversed(statements):
                outer, self._statement_at = self._statement_at, (number, statement)
                try:
                    result = self._statement(statement, path, value, number, parsed, depth)
                finally:
                    self._statement_at = outer
                if result is not None:
                    return result
        return None

    def _where(self, number: int, parsed: ParsedCell, node: ast.AST) -> str:
        line = parsed.raw_line(node)
        return f"In[{number}]" + (f" line {line}" if line else "")

    def _statement(
        self, statement: ast.stmt, path: ObjectPath, value: int, number: int, parsed: ParsedCell, depth: int
    ) -> Trace | None:
        if isinstance(statement, (ast.Assign, ast.AnnAssign)):
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            if statement.value is None:
                return None
            for target in targets:
                match = self._match_target(target, statement.value, path)
                if match is not None:
                    expression, rest, index = match
                    self._unpacked = index if isinstance(expression, ast.Call) else None
                    return self._resolve(expression, rest, value, number, parsed, depth)
        elif isinstance(statement, ast.AugAssign):
            augmented = path_of(statement.target)
            if augmented == path or (augmented is not None and _is_prefix(augmented, path)):
                return Trace((), f"{self._where(number, parsed, statement)} (computed: {_code(parsed, statement)})")
        elif isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call):
            return self._update_call(statement.value, path, value, number, parsed, depth)
        elif isinstance(statement, ast.ClassDef) and statement.name == path.root and path.steps:
            return self._class_attribute(statement, path.steps, value, number, parsed, depth)
        elif isinstance(statement, (ast.For, ast.AsyncFor, ast.With, ast.AsyncWith, ast.Import, ast.ImportFrom)) and (
            path.root in _bound_names(statement)
        ):
            return Trace((), f"{self._where(number, parsed, statement)} ({_code(parsed, statement)})")
        return None

    def _match_target(
        self, target: ast.AST, expression: ast.expr, path: ObjectPath
    ) -> tuple[ast.expr, tuple[Step, ...], int | None] | None:
        """When assigning ``expression`` to ``target`` sets ``path`` or an object on its way: what sets it,
        and which item of what it returns when the target unpacks a call's result."""
        if isinstance(target, (ast.Tuple, ast.List)):
            if isinstance(expression, (ast.Tuple, ast.List)) and len(expression.elts) == len(target.elts):
                for sub_target, sub_value in zip(target.elts, expression.elts):
                    match = self._match_target(sub_target, sub_value, path)
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
        if _is_prefix(bound, path):
            return expression, path.steps[len(bound.steps) :], None
        return None

    def _update_call(
        self, call: ast.Call, path: ObjectPath, value: int, number: int, parsed: ParsedCell, depth: int
    ) -> Trace | None:
        """``config.update(batch_size=64)`` / ``config.update({"batch_size": 64})`` on an object on the path."""
        if not (isinstance(call.func, ast.Attribute) and call.func.attr == "update"):
            return None
        receiver = path_of(call.func.value)
        if receiver is None or not (receiver == path or _is_prefix(receiver, path)) or receiver == path:
            return None
        rest = path.steps[len(receiver.steps) :]
        for keyword in call.keywords:
            if keyword.arg == rest[0].name:
                return self._resolve(keyword.value, rest[1:], value, number, parsed, depth)
        if call.args and isinstance(call.args[0], ast.Dict) and _dict_value(call.args[0], rest[0].name) is not None:
            return self._resolve(call.args[0], rest, value, number, parsed, depth)
        return None

    def _class_attribute(
        self, statement: ast.ClassDef, steps: tuple[Step, ...], value: int, number: int, parsed: ParsedCell, depth: int
    ) -> Trace | None:
        name = steps[0].name
        for item in reversed(statement.body):
            if isinstance(item, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in item.targets):
                return self._resolve(item.value, steps[1:], value, number, parsed, depth)
            if (
                isinstance(item, ast.AnnAssign)
                and isinstance(item.target, ast.Name)
                and item.target.id == name
                and item.value
            ):
                return self._resolve(item.value, steps[1:], value, number, parsed, depth)
        init = next((i for i in statement.body if isinstance(i, ast.FunctionDef) and i.name == "__init__"), None)
        if init is not None and len(steps) == 1:
            default = _parameter_default(init, str(name))
            if default is not None:
                return self._resolve(default, (), value, number, parsed, depth)
        return None

    # -- expressions ---------------------------------------------------------------------------------
    def _resolve(
        self, expression: ast.expr, steps: tuple[Step, ...], value: int, number: int, parsed: ParsedCell, depth: int
    ) -> Trace | None:
        where = self._where(number, parsed, expression)
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
            inner = _dict_value(expression, steps[0].name)
            if inner is None:
                return Trace((), f"{where} ({_code(parsed, expression)}, without {steps[0].name!r})")
            return self._resolve(inner, steps[1:], value, number, parsed, depth)
        if isinstance(expression, ast.Call):
            return self._through_call(expression, steps, value, number, parsed, depth)
        if isinstance(expression, ast.Subscript) and isinstance(expression.value, ast.Call):
            # ``parser.parse_known_args()[0]``
            return self._through_call(expression.value, steps, value, number, parsed, depth)
        inner_path = path_of(expression)
        if inner_path is not None:
            return self._follow(ObjectPath(inner_path.root, inner_path.steps + steps), value, depth)
        if isinstance(expression, ast.Constant) and isinstance(expression.value, str):
            return self._in_text(expression, steps, value, number, parsed)
        return Trace((), f"{where} ({_code(parsed, expression)})")

    def _follow(self, path: ObjectPath, value: int, depth: int) -> Trace:
        """Trace another path the value came from; it holds the same value now, so it changes too."""
        inner = self.trace(path, value, depth + 1)
        holds = resolve(self.namespace, path)
        via = (path,) if found(holds) and type(holds) is int and holds == value else ()
        if inner is None:
            return Trace((), f"from {path.text}", via)
        return Trace(inner.written, inner.origin, via + inner.via)

    def _number(self, expression: ast.expr, value: int, number: int, parsed: ParsedCell, depth: int) -> Trace | None:
        where = self._where(number, parsed, expression)
        literal = int_constant(expression)
        if literal is not None:
            span = parsed.span(expression)
            if literal != value:
                return Trace((), f"{where} wrote {literal}; it is {value} now")
            return Trace((Written(number, span),) if span else (), where)
        if (
            isinstance(expression, ast.Constant)
            and isinstance(expression.value, str)
            and expression.value.strip().isdigit()
        ):
            digits = _digits_span(parsed, expression, expression.value.strip())
            return Trace((Written(number, digits),) if digits and int(expression.value) == value else (), where)
        if isinstance(expression, ast.Name) and expression.id in self._parameters:
            argument, caller, caller_parsed = self._parameters.pop(expression.id)
            return self._number(argument, value, caller, caller_parsed, depth)
        inner_path = path_of(expression)
        if inner_path is not None:
            return self._follow(inner_path, value, depth)
        if _constant_arithmetic(expression) and parsed.span(expression) is not None:
            span = parsed.span(expression)
            assert span is not None
            return Trace((Written(number, span),), f"{where} (computed: {_code(parsed, expression)})")
        return Trace((), f"{where} (computed: {_code(parsed, expression)})")

    def _through_call(
        self, call: ast.Call, steps: tuple[Step, ...], value: int, number: int, parsed: ParsedCell, depth: int
    ) -> Trace | None:
        name = str(steps[0].name)
        where = self._where(number, parsed, call)
        unpacked, self._unpacked = self._unpacked, None
        for keyword in call.keywords:
            if keyword.arg == name:
                return self._resolve(keyword.value, steps[1:], value, number, parsed, depth)
        function = call.func
        if isinstance(function, ast.Attribute) and function.attr in ("parse_args", "parse_known_args"):
            return self._argparse(call, name, value, number, parsed)
        if name == "hparams" and len(steps) > 1:  # Lightning's save_hyperparameters keeps __init__'s arguments
            return self._through_call(call, steps[1:], value, number, parsed, depth)
        if call.args and isinstance(call.args[0], ast.Dict) and _dict_value(call.args[0], name) is not None:
            return self._resolve(call.args[0], steps, value, number, parsed, depth)  # OmegaConf.create({...})
        if call.args and isinstance(call.args[0], (ast.Constant, ast.Name)):
            text = call.args[0]
            if isinstance(text, ast.Name):
                text_trace = self._string_source(text.id)
                if text_trace is not None:
                    return text_trace(steps, value)
            elif isinstance(text.value, str):
                found_in_text = self._in_text(text, steps, value, number, parsed)
                if found_in_text.written:
                    return found_in_text
        callee_path = path_of(function)
        callee = resolve(self.namespace, callee_path) if callee_path is not None else None
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
            defined = self.definition(function.attr if isinstance(function, ast.Attribute) else function.id)
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
                        f"{where} (not given: the default of {callee_name})",
                    )
                return Trace((), f"{where} (not given: the default of {callee_name})")
        return Trace((), f"{where} ({_code(parsed, call)})")

    def _through_return(
        self,
        call: ast.Call,
        callee: Any,
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
        defined = self.definition(callee.__name__)
        if defined is None or not isinstance(defined[2], (ast.FunctionDef, ast.AsyncFunctionDef)):
            return None
        function_number, function_parsed, definition = defined
        assert isinstance(definition, (ast.FunctionDef, ast.AsyncFunctionDef))
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
            for statement in _statements(definition.body):
                if isinstance(statement, ast.Assign):
                    for target in statement.targets:
                        match = self._match_target(target, statement.value, ObjectPath(returned.id))
                        if match is not None and match[2] is None:
                            assigned = match[0]
            if assigned is not None:
                returned = assigned
        try:
            bound = inspect.signature(callee).bind_partial(
                *call.args, **{k.arg: k.value for k in call.keywords if k.arg}
            )
        except (TypeError, ValueError):
            bound = None
        saved = self._parameters
        self._parameters = {a.arg: (d, function_number, function_parsed) for a, d in _defaults(definition)}
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
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if (
                    isinstance(item, ast.AnnAssign)
                    and isinstance(item.target, ast.Name)
                    and item.target.id == name
                    and item.value is not None
                ):
                    return self._number(item.value, value, number, parsed, 0)  # a dataclass field
                if isinstance(item, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in item.targets):
                    return self._number(item.value, value, number, parsed, 0)
            init = next((i for i in node.body if isinstance(i, ast.FunctionDef) and i.name == "__init__"), None)
            if init is None:
                return None
            node = init
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            default = _parameter_default(node, name)
            if default is not None:
                return self._number(default, value, number, parsed, 0)
        return None

    def default_of(self, function_name: str, parameter: str, value: int) -> Trace | None:
        """Where a notebook function's parameter default is written."""
        defined = self.definition(function_name)
        return None if defined is None else self._default_in_definition(defined, parameter, value)

    # -- settings written as text ---------------------------------------------------------------------
    def _argparse(self, call: ast.Call, dest: str, value: int, number: int, parsed: ParsedCell) -> Trace:
        """``parser.parse_args(["--batch-size", "64"])``, or the option's default where it was added."""
        where = self._where(number, parsed, call)
        parser_path = path_of(call.func.value) if isinstance(call.func, ast.Attribute) else None
        parser = resolve(self.namespace, parser_path) if parser_path is not None else None
        options = [
            o for a in getattr(parser, "_actions", []) if getattr(a, "dest", None) == dest for o in a.option_strings
        ]
        if not options:
            options = [f"--{dest}", f"--{dest.replace('_', '-')}"]
        given = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "args"), None)
        if isinstance(given, (ast.List, ast.Tuple)):
            items = given.elts
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
                    span = _digits_span(parsed, target, text.strip())
                    if span is not None and int(text) == value:
                        return Trace((Written(number, span),), where)
                return Trace((), f"{where} ({_code(parsed, item)})")
        elif isinstance(given, ast.Call) and isinstance(given.func, ast.Attribute) and given.func.attr == "split":
            text_node = given.func.value
            if isinstance(text_node, ast.Constant) and isinstance(text_node.value, str):
                for option in options:
                    match = re.search(rf"(?:^|\s){re.escape(option)}[\s=]+(\d+)\b", text_node.value)
                    if match and int(match.group(1)) == value:
                        span = _digits_span(parsed, text_node, match.group(1), option)
                        if span is not None:
                            return Trace((Written(number, span),), where)
        return self._argparse_default(options, value) or Trace((), f"{where} (the parser's default)")

    def _argparse_default(self, options: list[str], value: int) -> Trace | None:
        for number in self.numbers():
            parsed = self.parsed(number)
            if parsed is None:
                continue
            for node in ast.walk(parsed.tree):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                    continue
                if node.func.attr == "add_argument" and any(
                    isinstance(a, ast.Constant) and a.value in options for a in node.args
                ):
                    default = next((k.value for k in node.keywords if k.arg == "default"), None)
                    if default is not None:
                        return self._number(default, value, number, parsed, 0)
                if node.func.attr == "set_defaults":
                    default = next(
                        (k.value for k in node.keywords if k.arg in {o.lstrip("-").replace("-", "_") for o in options}),
                        None,
                    )
                    if default is not None:
                        return self._number(default, value, number, parsed, 0)
        return None

    def _string_source(self, name: str):
        """A name bound to a string literal (YAML text), as a function tracing a key path through it."""
        for number in self.numbers():
            parsed = self.parsed(number)
            if parsed is None:
                continue
            for statement in reversed(list(_statements(parsed.tree.body))):
                if isinstance(statement, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == name for t in statement.targets
                ):
                    node = statement.value
                    if isinstance(node, ast.Constant) and isinstance(node.value, str):
                        return lambda steps, value, n=number, p=parsed, c=node: self._in_text(c, steps, value, n, p)
                    return None
        return None

    def _in_text(
        self, node: ast.Constant, steps: tuple[Step, ...], value: int, number: int, parsed: ParsedCell
    ) -> Trace:
        """A setting inside a string literal: YAML, JSON or ``key=value`` (``batch_size: 64``)."""
        where = self._where(number, parsed, node)
        key = str(steps[-1].name) if steps else ""
        first = parsed.raw_line(node)
        last = parsed.line_map.get(getattr(node, "end_lineno", 0) or 0)
        if not key or first is None or last is None:
            return Trace((), where)
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
        return Trace((), where)


# -- helpers ----------------------------------------------------------------------------------------------
def _is_prefix(prefix: ObjectPath, path: ObjectPath) -> bool:
    return (
        prefix.root == path.root
        and len(prefix.steps) < len(path.steps)
        and path.steps[: len(prefix.steps)] == prefix.steps
    )


def _assigned_names(statement: ast.stmt) -> set[str]:
    """Names a statement binds other than by ``=`` (a loop, ``with ... as``, an import, a definition); ``+=``
    keeps the object (and a tensor its shape), so it is not one."""
    if isinstance(statement, (ast.For, ast.AsyncFor, ast.With, ast.AsyncWith, ast.Import, ast.ImportFrom)):
        return _bound_names(statement)
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {statement.name}
    return set()


def _bound_names(statement: ast.stmt) -> set[str]:
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


def _dict_value(node: ast.Dict, key: str | int) -> ast.expr | None:
    for dict_key, dict_value in zip(node.keys, node.values):
        if isinstance(dict_key, ast.Constant) and dict_key.value == key:
            return dict_value
    return None


def _defaults(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[tuple[ast.arg, ast.expr]]:
    args = function.args
    positional = args.posonlyargs + args.args
    pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults))
    return pairs + [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]


def _parameter_default(function: ast.FunctionDef | ast.AsyncFunctionDef, name: str) -> ast.expr | None:
    args = function.args
    positional = args.posonlyargs + args.args
    for arg, default in zip(positional[len(positional) - len(args.defaults) :], args.defaults):
        if arg.arg == name:
            return default
    for arg, kw_default in zip(args.kwonlyargs, args.kw_defaults):
        if arg.arg == name and kw_default is not None:
            return kw_default
    return None


def _bound_argument(callee: Any, call: ast.Call, name: str) -> ast.expr | None:
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


def _passed_through(call: ast.Call, namespace: Mapping[str, Any], unpacked: int | None) -> ast.expr | None:
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


def _code(parsed: ParsedCell, node: ast.AST) -> str:
    line = parsed.raw_line(node)
    text = parsed.line_text(line).strip() if line else ""
    return text if len(text) <= 80 else text[:79] + "…"


def _digits_span(parsed: ParsedCell, node: ast.AST, digits: str, after: str | None = None) -> Span | None:
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
