"""Reading calls: what a call says about the values it is given.

A call is where most batch evidence is: ``batch_size=`` keywords, a tensor constructor's shape, a
``view``/``reshape``, ``split``/``chunk``, a ``range`` step, items stacked into a tensor, a model fed
whole, printing (which says nothing). Calls into notebook code are followed by the body's reader
(``reader.BodyReader.follow_call``); the expressions inside a call are read by ``expressions``.
"""

from __future__ import annotations

import ast
import inspect
from typing import Any

from ..cell.source import callable_name, dotted_name, int_constant
from .body import Body, Expressions
from .cell_numbers import Constructor
from .libraries import found, is_module, is_user_class, is_user_function, resolve
from .names import batch_like, generation_count, name_score
from .reads import CELL_BONUS, MAX_FUNCTION_DEPTH, STATE_BATCH, STATE_LAYERS, USE_SCORES, Use
from .tensors import SHAPE_CONSTRUCTORS, matrix_dims, shape_nodes, whole_tensor

_RESHAPES = {"view", "reshape", "expand", "repeat", "new_zeros", "new_ones", "new_empty"}
_PRINT_FUNCTIONS = {"print", "display", "pprint", "repr", "str", "format"}
_PRINT_METHODS = {
    "set_description",
    "set_postfix",
    "set_postfix_str",
    "add_scalar",
    "add_scalars",
    "log_metrics",
    "log_param",
    "log_params",
    "log_dict",
    "format",
}
_MAYBE_PRINT_METHODS = {"log", "info", "debug", "warning", "warn", "error", "write"}  # torch.log is not printing
_MATH_MODULES = {"torch", "np", "numpy", "math", "F", "jnp", "jax", "scipy"}
_ITERATION_WRAPPERS = {"enumerate", "iter", "next", "tqdm", "zip", "islice", "cycle", "chain", "trange", "track"}
_INSPECTORS = {"len", "isinstance", "type", "hasattr", "getattr", "id", "callable", "vars", "dir"}
_MATMULS = {"mm", "matmul", "bmm", "einsum", "mv", "addmm", "baddbmm"}
# Callables that make one tensor of a list of items: the list's length is a batch.
_STACKERS = {"stack", "cat", "concat", "concatenate", "vstack", "tensor", "as_tensor", "array", "asarray"}


class CallReader:
    """The calls of one body, read for the batch evidence in their arguments."""

    def __init__(self, body: Body, expressions: Expressions):
        self.body = body
        self.expressions = expressions

    def call(self, node: ast.Call, use: Use) -> None:
        """A call the body makes, used as ``use`` (printed, iterated...): what it calls, then its arguments."""
        name = callable_name(node)
        dotted = dotted_name(node.func) or ""
        function = node.func
        if use is Use.PRINTED or _prints(node, name, dotted):
            for child in node.args + [k.value for k in node.keywords]:
                self.expressions.expr(child, Use.PRINTED)
            if isinstance(function, ast.Attribute):
                self.expressions.expr(function.value, Use.PRINTED)
            return
        self._phase(node, name)
        # What is called.
        if isinstance(function, ast.Attribute):
            receiver = self.body.scope.namespace_path(function.value)
            if receiver is not None:
                self.expressions.record(function.value, Use.OTHER, method=name)
            else:
                self.expressions.expr(function.value, Use.OTHER)
        elif isinstance(function, ast.Name):
            callee = self.body.scope.namespace_path(function)
            if callee is not None:
                self.body.scan.read(callee).called = True
                self.expressions.record(function, Use.OTHER)
        else:
            self.expressions.expr(function, Use.OTHER)
        # Its arguments.
        if name in SHAPE_CONSTRUCTORS and (
            dotted.startswith(("torch.", "np.", "numpy.")) or isinstance(function, ast.Attribute)
        ):
            self._shape_call(node, name)
            return
        if name in _RESHAPES and isinstance(function, ast.Attribute):
            for index, argument in enumerate(node.args):
                self.expressions.expr(argument, Use.DIMENSION if index == 0 else Use.OTHER, index)
            return
        if name in _INSPECTORS:
            for argument in node.args:
                self.expressions.expr(argument, Use.OTHER)
            return
        if name in _MATMULS:
            for argument in node.args:
                self.expressions.expr(argument, Use.MATMUL)
            return
        if name == "range" and len(node.args) == 3:
            self.expressions.expr(node.args[0], Use.OTHER)
            self.expressions.expr(node.args[1], Use.OTHER)
            self.expressions.expr(node.args[2], Use.STEP)
            if self.body.cell:
                self.body.numbers.add_use("range step", Use.STEP, node.args[2], "range(..., {})", code=node)
            return
        if name in ("split", "chunk", "array_split", "tensor_split") and self._size_call(node, name, dotted):
            return
        if name in _STACKERS and node.args and isinstance(node.args[0], (ast.ListComp, ast.GeneratorExp)):
            self._stacked_count(node.args[0])
        if name in _ITERATION_WRAPPERS:
            iterate = use is Use.ITERATED or name in ("iter", "next")
            for argument in node.args:
                self.expressions.expr(argument, Use.ITERATED if iterate else Use.ARGUMENT)
            for keyword in node.keywords:
                self.expressions.expr(keyword.value, Use.OTHER)
            return
        self._arguments(node, name)

    def _phase(self, node: ast.Call, name: str) -> None:
        if name in ("backward", "fit", "zero_grad") or (name == "train" and not node.args and not node.keywords):
            self.body.scan.trains = True
        elif name in ("step",) and isinstance(node.func, ast.Attribute):
            receiver = dotted_name(node.func.value) or ""
            if any(word in receiver.lower() for word in ("optim", "opt", "scaler")):
                self.body.scan.trains = True
        elif name in ("evaluate", "predict", "validate", "test", "eval", "generate"):
            self.body.scan.evaluates = True

    def _shape_call(self, node: ast.Call, name: str) -> None:
        shape = shape_nodes(node, name)
        shape_ids = {id(n) for n in shape}
        body = self.body
        state = body.cell and body.assigning in body.scan.states and len(shape) == 3
        matrix = matrix_dims(shape, body.scan.contracted.get(body.assigning or "", set()) if body.cell else set())
        for index, dimension in enumerate(shape):
            if index in matrix:
                self.expressions.expr(dimension, Use.MATMUL)  # a matrix's side or inner size, not a batch
                continue
            dim = (STATE_BATCH if index == 1 else STATE_LAYERS if index == 0 else index) if state else index
            self.expressions.expr(dimension, Use.DIMENSION, dim)
        for argument in node.args:
            if id(argument) not in shape_ids and not (
                isinstance(argument, (ast.Tuple, ast.List)) and any(id(e) in shape_ids for e in argument.elts)
            ):
                self.expressions.expr(argument, Use.OTHER)
        for keyword in node.keywords:
            if not (keyword.arg == "size" and isinstance(keyword.value, (ast.Tuple, ast.List))):
                self.expressions.expr(keyword.value, Use.OTHER)
        if self.body.cell and shape and any(int_constant(n) is not None for n in shape):
            self.body.numbers.constructors.append(Constructor(node, shape, self.body.assigning, frozenset(matrix)))

    def _size_call(self, node: ast.Call, name: str, dotted: str) -> bool:
        """``x.split(64)``, ``torch.split(x, 64)``, ``x.chunk(4)``: a batch size or a count of chunks."""
        module_call = dotted.startswith(("torch.", "np.", "numpy."))
        arguments = node.args[1:] if module_call else node.args
        receiver = (
            node.args[0]
            if module_call and node.args
            else (node.func.value if isinstance(node.func, ast.Attribute) else None)
        )
        if not arguments or isinstance(arguments[0], ast.Constant) and isinstance(arguments[0].value, str):
            return False  # ``line.split(",")``: a string
        if receiver is not None and isinstance(receiver, ast.Constant):
            return False
        size = arguments[0]
        counts = name in ("chunk", "array_split", "tensor_split")
        self.expressions.expr(receiver, Use.OTHER)
        self.expressions.expr(size, Use.CHUNKS if counts else Use.SPLIT)
        for extra in arguments[1:] + [k.value for k in node.keywords]:
            self.expressions.expr(extra, Use.OTHER)
        value = int_constant(size)
        if self.body.cell and value is not None and value >= 2:
            label = name + "({})"
            if counts:
                chunked = self.body.scope.namespace_path(receiver) if receiver is not None else None
                total = _leading_size(resolve(self.body.scan.namespace, chunked)) if chunked is not None else None
                if total:
                    self.body.numbers.add_use("chunks", Use.CHUNKS, size, label, code=node, total=total)
            else:
                self.body.numbers.add_use("split", Use.SPLIT, size, label, code=node)
        return True

    def _stacked_count(self, comprehension: ast.ListComp | ast.GeneratorExp) -> None:
        """``torch.stack([dataset[i][0] for i in range(512)])``: the count of the range is the batch."""
        generator = comprehension.generators[0]
        iterable = generator.iter
        if not (isinstance(iterable, ast.Call) and callable_name(iterable) == "range" and 1 <= len(iterable.args) <= 2):
            return
        if len(iterable.args) == 2 and int_constant(iterable.args[0]) != 0:
            return
        count = iterable.args[-1]
        self.expressions.expr(count, Use.STACKED)
        if self.body.cell:
            self.body.numbers.add_use("count", Use.STACKED, count, "range({})", code=iterable)

    def _arguments(self, node: ast.Call, name: str) -> None:
        callee = self._callee(node)
        parameters = _positional_parameters(callee, name)
        readable = is_user_function(callee) or (inspect.ismethod(callee) and is_user_class(type(callee.__self__)))
        opaque = not readable and name not in self.body.functions_defined
        # A model's constructor takes sizes of the model (layers, a context length), not a batch.
        kept = self.body.follower.kept_uses(callee) if is_user_class(callee) and not is_module(callee) else {}
        if self.body.cell and is_module(self._module_called(node, callee)):
            for argument in node.args + [k.value for k in node.keywords]:
                fed = self.body.scope.namespace_path(whole_tensor(argument))
                if fed is not None:
                    self.body.scan.read(fed).fed = True
        for index, argument in enumerate(node.args):
            parameter = parameters[index] if index < len(parameters) else None
            self._argument(argument, parameter, opaque, kept.get(parameter or ""))
        for keyword in node.keywords:
            self._argument(keyword.value, keyword.arg, opaque, kept.get(keyword.arg or ""))
        if callee is not None and self.body.depth < MAX_FUNCTION_DEPTH:
            self.body.follower.follow_call(node, callee)

    def _argument(self, argument: ast.expr, parameter: str | None, opaque: bool, kept: Use | None = None) -> None:
        if parameter and kept is not None and not batch_like(parameter):
            # ``DataLoaderLite(B=16, T=1024)``: the class keeps B and uses it as a batch in a method.
            self.expressions.expr(argument, kept, 0 if kept is Use.DIMENSION else None)
            if self.body.cell:
                score = USE_SCORES[kept] + CELL_BONUS
                self.body.numbers.add("keyword", parameter, argument, score, (f"{kept.value} in the class",))
            return
        if parameter and batch_like(parameter):
            use = Use.GENERATION if generation_count(parameter) else Use.BATCH_ARGUMENT
            self.expressions.expr(argument, use)
            if self.body.cell:
                named = name_score(parameter) + (1 if parameter == "batch_size" else 0)
                self.body.numbers.add_use("keyword", use, argument, parameter, extra_score=named)
            return
        path = self.body.scope.namespace_path(argument)
        if path is not None:
            self.expressions.record(argument, Use.ARGUMENT)
            if opaque:
                self.body.scan.read(path).opaque_argument = True
            return
        self.expressions.expr(argument, Use.OTHER)

    def _callee(self, node: ast.Call) -> object:
        path = self.body.scope.namespace_path(node.func)
        if path is None:
            return None
        value = resolve(self.body.scan.namespace, path)
        return value if found(value) else None

    def _module_called(self, node: ast.Call, callee: object) -> object:
        """What the cell calls: from the namespace, or, for a name the cell bound before the call, what it
        held when the cell failed (the model it built)."""
        if callee is not None or not isinstance(node.func, ast.Name) or node.func.id not in self.body.scope.bound_at:
            return callee
        return self.body.scan.namespace.get(node.func.id)


def _prints(node: ast.Call, name: str, dotted: str) -> bool:
    """``print(...)``, ``logger.info(...)``, ``pbar.set_postfix(...)``, ``"{}".format(...)``: output only."""
    if isinstance(node.func, ast.Name):
        return name in _PRINT_FUNCTIONS
    if name in _PRINT_METHODS:
        return True
    return name in _MAYBE_PRINT_METHODS and dotted.split(".")[0] not in _MATH_MODULES


def _positional_parameters(callee: Any, name: str) -> list[str | None]:
    if callee is not None:
        try:
            parameters = list(inspect.signature(callee).parameters.values())
            return [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        except (TypeError, ValueError):
            pass
    if name.endswith("DataLoader"):
        return ["dataset", "batch_size"]
    return []


def _leading_size(value: object) -> int | None:
    shape = getattr(value, "shape", None)
    if shape is not None and len(shape) > 0:
        try:
            return int(shape[0])
        except (TypeError, ValueError):
            return None
    try:
        return len(value) if isinstance(value, (list, tuple)) else None
    except TypeError:
        return None
