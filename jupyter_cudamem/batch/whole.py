"""Whether a cell's batch is the data itself: then a smaller batch is not a fix, it is a smaller result.

A training cell's batch is a sample of the data: a smaller one is another step of the same training
(and gradient accumulation keeps the effective batch). An inference cell or a metric over a whole
tensor is different: ``features = torch.randn(32768, ...)`` then ``predictions = classifier(features)``
computes one prediction per row, and a rerun with 12,923 rows leaves ``predictions`` with 12,923 rows
under the cell's name, as if that were the cell's result.

The rules, decided on the cell's code (never on its numbers):

1. The cell does not train (no ``.backward()``, no optimizer or trainer step: ``CellTraits.trains``).
2. The data is sized by the batch: the chosen knob is a tensor's literal leading dimension, a slice
   bound (``images[:32768]``), or an integer used as a tensor's batch dimension or a slice bound, and
   never as a range step, split size, chunk count or a ``batch_size=`` argument (those already walk
   over all of the data, so a smaller one keeps every row). With no knob at all, or when the knob is
   the rows of such a tensor, a tensor from an earlier cell passed whole to a model (``model(x_all)``)
   is the data.
3. That data is made at the cell's top level (inside ``with``/``if``/``try`` counts; inside a ``for``
   or ``while`` loop each pass is its own batch, so it does not).
4. A result computed from it is kept: assigned to a name (anywhere in the cell), or the value the
   cell's last line shows. A computation is any call on the data other than moving or reshaping it
   (``.to``, ``.cuda``, ``.float``, ``.view``...).

``WholeData.chunkable`` (``knobs``, beside the finding that carries it) then says whether ``%oomfix`` may process the data in chunks instead
(``oomfix.whole_data``): each model call over the data (a module from the namespace, called with the
data as its one positional argument, on one line, at the top level) becomes
``torch.cat([model(_chunk).detach() for _chunk in data.split(n)])``; otherwise ``problem`` says why not.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator, Mapping

from ..cell.read import ReadCell, read_cell
from ..cell.source import ParsedCell, dotted_name
from .knobs import BatchFinding, Knob, KnobKind, ModelCall, Value, WholeData
from .libraries import is_module

# How a knob must not be used for the data to be sized by it: each of these walks over all the data.
_ITERATING_USES = {"a range step", "a split size", "a number of chunks", "passed as a batch size"}
_SIZING_USES = {"a tensor's batch dimension", "a slice bound"}
# Methods that move, cast or reshape data: their result is still the data, not a result computed from it.
_DATA_PREP = {
    "to",
    "cuda",
    "cpu",
    "float",
    "half",
    "double",
    "bfloat16",
    "long",
    "int",
    "type",
    "contiguous",
    "view",
    "reshape",
    "permute",
    "transpose",
    "unsqueeze",
    "squeeze",
    "flatten",
    "clone",
    "detach",
    "requires_grad_",
    "pin_memory",
    "split",
    "chunk",
}
_PRINTERS = {"print", "display", "pprint", "logging.info", "logger.info", "log.info"}
_CONSTRUCTORS = {"randn", "rand", "zeros", "ones", "empty", "full", "randint", "normal", "tensor", "arange", "linspace"}


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements that run once per cell run: into ``with``/``if``/``try``, never into loops or definitions."""
    for statement in body:
        yield statement
        if isinstance(statement, (ast.With, ast.AsyncWith)):
            yield from _top_level(statement.body)
        elif isinstance(statement, ast.If):
            yield from _top_level(statement.body)
            yield from _top_level(statement.orelse)
        elif isinstance(statement, ast.Try):
            for block in (statement.body, statement.orelse, statement.finalbody):
                yield from _top_level(block)


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _targets(statement: ast.stmt) -> list[str]:
    if isinstance(statement, ast.Assign):
        targets = statement.targets
    elif isinstance(statement, (ast.AnnAssign, ast.AugAssign)):
        targets = [statement.target]
    else:
        return []
    found: list[str] = []
    for target in targets:
        found.extend(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return found


def _value(statement: ast.stmt) -> ast.AST | None:
    if isinstance(statement, (ast.Assign, ast.AugAssign, ast.Expr)):
        return statement.value
    if isinstance(statement, ast.AnnAssign):
        return statement.value
    return None


def _sizes_data(knob: Knob) -> bool:
    if knob.kind not in (KnobKind.CELL, KnobKind.VARIABLE):
        return False
    uses = set(knob.evidence)
    if uses & _ITERATING_USES:
        return False
    return knob.form in ("tensor", "slice") or bool(uses & _SIZING_USES)


def _knob_variable(knob: Knob) -> str | None:
    for target in knob.live:
        if isinstance(target, Value) and not target.path.steps:
            return target.path.root
    return knob.label if knob.label.isidentifier() and knob.form in ("assignment", "value") else None


def _computes_on(node: ast.AST, data: set[str]) -> bool:
    """Whether ``node`` computes something from the data: a call (other than moving or reshaping it, or
    making a tensor) with the data among its arguments or as its object, or arithmetic on the data."""
    for child in ast.walk(node):
        if isinstance(child, ast.Call):
            func = child.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in _DATA_PREP or name in _CONSTRUCTORS:
                continue
            operands = [*child.args, *(k.value for k in child.keywords)]
            if isinstance(func, ast.Attribute):
                operands.append(func.value)
            if any(_names(operand) & data for operand in operands):
                return True
        elif isinstance(child, (ast.BinOp, ast.Compare)):
            if _names(child) & data:
                return True
    return False


def _resolve_callee(call: ast.Call, namespace: Mapping[str, object]) -> object:
    callee = dotted_name(call.func)
    if callee is None:
        return None
    root, *rest = callee.split(".")
    value: object = namespace.get(root)
    for part in rest:
        value = getattr(value, part, None)
    return value


def _is_model_call(node: ast.AST, data: set[str], namespace: Mapping[str, object]) -> bool:
    """A call of a module from the namespace with the data among its positional arguments."""
    if not isinstance(node, ast.Call):
        return False
    value = _resolve_callee(node, namespace)
    return value is not None and is_module(value) and any(_names(a) & data for a in node.args)


def _model_calls(node: ast.AST, data: set[str], namespace: Mapping[str, object]) -> list[ast.Call]:
    return [child for child in ast.walk(node) if isinstance(child, ast.Call) and _is_model_call(child, data, namespace)]


def _namespace_tensors(parsed: ParsedCell, namespace: Mapping[str, object], bound: set[str]) -> dict[str, int]:
    """Tensors from earlier cells the cell reads (and does not bind first), with their leading size."""
    found: dict[str, int] = {}
    for name in _names(parsed.tree):
        if name in bound:
            continue
        value = namespace.get(name)
        shape = getattr(value, "shape", None)
        if shape is None or not callable(getattr(value, "split", None)) or is_module(value):
            continue
        try:
            if len(shape) >= 1 and int(shape[0]) >= 2:
                found[name] = int(shape[0])
        except (TypeError, ValueError):
            continue
    return found


def covers_whole_data(
    finding: BatchFinding,
    namespace: Mapping[str, object] | None = None,
    transform: Callable[[str], str] | None = None,
    read: ReadCell | None = None,
) -> WholeData | None:
    """``WholeData`` when the cell's batch is its data (see the module docstring), else ``None``. ``read``:
    the cell as already read (``cell.read``), where the caller has it."""
    namespace = namespace if namespace is not None else {}
    read = read if read is not None else read_cell(finding.source, transform)
    parsed = read.parsed
    if parsed is None or read.traits.trains:  # a cell that does not parse has no batch to judge
        return None
    knob = finding.chosen
    statements = list(_top_level(parsed.tree.body))
    spans = {w.span for w in knob.written if w.cell is None} if knob is not None else set()
    variable = _knob_variable(knob) if knob is not None else None
    data: set[str] = set()
    rows: int | None = None
    seeded_by_knob = False
    if knob is not None and _sizes_data(knob):
        rows = knob.value

        def is_knob(node: ast.AST) -> bool:
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                return node.id == variable
            return isinstance(node, ast.Constant) and parsed.span(node) in spans

        for statement in statements:
            value = _value(statement)
            targets = _targets(statement)
            if value is None or variable in targets or isinstance(value, ast.Constant):
                continue
            sliced = [
                node
                for node in ast.walk(value)
                if isinstance(node, ast.Subscript) and any(is_knob(c) for c in ast.walk(node.slice))
            ]
            if sliced:
                # ``images[:32768]``: the sliced tensor is the data; what the statement binds follows from it.
                data.update(name for node in sliced for name in _names(node.value))
            elif targets and any(is_knob(node) for node in ast.walk(value)):
                data.update(targets)  # ``features = torch.randn(batch_size, ...)``: the data, made here
            else:
                continue
            seeded_by_knob = True
    elif knob is None or not knob.changeable or knob.kind is KnobKind.TENSOR:
        bound = {t for s in ast.walk(parsed.tree) if isinstance(s, ast.stmt) for t in _targets(s)}
        tensors = _namespace_tensors(parsed, namespace, bound)
        whole = {name for name in tensors if any(_model_calls(v, {name}, namespace) for v in map(_value, statements) if v)}
        if whole:
            data.update(whole)
            rows = max(tensors[name] for name in whole)
    if not data:
        return None
    # Follow the data through the cell: names bound from it are the data (moved, cast) or results.
    results: list[str] = []
    for statement in statements:
        value = _value(statement)
        if value is None or not (_names(value) & data):
            continue
        targets = _targets(statement)
        if targets:
            if _computes_on(value, data):
                results.extend(t for t in targets if t not in results)
            data.update(targets)
    last = parsed.tree.body[-1] if parsed.tree.body else None
    printed = isinstance(last, ast.Expr) and isinstance(last.value, ast.Call) and (
        dotted_name(last.value.func) in _PRINTERS
    )
    if isinstance(last, ast.Expr) and not printed and _names(last.value) & data and _computes_on(last.value, data):
        results.append("Out")
    # A result kept from inside a loop (``outputs.append(model(x))``) counts as kept too.
    for node in ast.walk(parsed.tree):
        if isinstance(node, (ast.For, ast.While)):
            for inner in ast.walk(node):
                if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute) and inner.func.attr in (
                    "append",
                    "extend",
                ):
                    if any(_names(a) & data for a in inner.args) and any(_computes_on(a, data) for a in inner.args):
                        name = dotted_name(inner.func.value)
                        if name and name not in results:
                            results.append(name)
    if not results:
        return None
    return _decided(parsed, knob if seeded_by_knob else None, rows, tuple(results), data, namespace, statements)


def _decided(
    parsed: ParsedCell,
    knob: Knob | None,
    rows: int | None,
    results: tuple[str, ...],
    data: set[str],
    namespace: Mapping[str, object],
    statements: list[ast.stmt],
) -> WholeData:
    kept = ", ".join(results)
    over = f"{rows:,} rows" if rows else "all of its rows"
    sized = f" sized by {knob.label} = {knob.value}" if knob is not None else " from an earlier cell"
    reason = (
        f"the cell computes {kept} over the whole data ({over}{sized}) and keeps it, and it does not train: "
        f"a smaller batch would leave {kept} with fewer rows"
    )
    on_top = {id(s) for s in statements}
    parents = {id(child): node for node in ast.walk(parsed.tree) for child in ast.iter_child_nodes(node)}
    text = "".join(parsed.transformed_lines)
    calls: list[ModelCall] = []
    problem: str | None = None
    for node in ast.walk(parsed.tree):
        if not isinstance(node, ast.Call) or not _is_model_call(node, data, namespace):
            continue
        statement, looped = _statement_of(node, parents)
        callee = ast.get_source_segment(text, node.func) or "the model"
        argument = ast.get_source_segment(text, node.args[0]) if len(node.args) == 1 else None
        span = parsed.span(node)
        if statement is None or id(statement) not in on_top or looped:
            problem = f"{callee}(...) runs in a loop over the data; process it in chunks there instead"
        elif argument is None:
            problem = f"{callee}(...) takes more than the data as positional arguments, so it cannot be split safely"
        elif span is None:
            problem = f"{callee}(...) spans lines or was rewritten by IPython, so it cannot be rewritten safely"
        else:
            calls.append(ModelCall(span, callee, argument))
    if problem is None and not calls:
        problem = "the result is not computed by a model from the namespace, so it cannot be split into chunks safely"
    if problem is None and "torch" not in namespace:
        problem = "torch is not imported in the notebook, so the chunks cannot be joined with torch.cat"
    if problem is None and any(_sequence_first(c.callee, namespace) for c in calls):
        problem = "the model takes sequence-first input, so rows are not the first dimension"
    return WholeData(knob.label if knob is not None else None, rows, results, reason, tuple(calls), problem)


def _statement_of(target: ast.AST, parents: dict[int, ast.AST]) -> tuple[ast.stmt | None, bool]:
    """The statement holding ``target``, and whether a comprehension or lambda lies between them."""
    looped = False
    node: ast.AST | None = parents.get(id(target))
    while node is not None and not isinstance(node, ast.stmt):
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp, ast.Lambda)):
            looped = True
        node = parents.get(id(node))
    return node, looped


def _sequence_first(callee: str, namespace: Mapping[str, object]) -> bool:
    from .libraries import sequence_first

    root, *rest = callee.split(".")
    value: object = namespace.get(root)
    for part in rest:
        value = getattr(value, part, None)
    return value is not None and is_module(value) and sequence_first(value)
