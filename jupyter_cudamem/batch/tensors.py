"""Tensors whose shape is the batch: how a constructor's shape is written, and tensors an earlier cell made.

``inputs = torch.randn(64, 3, 224, 224)`` in one cell and ``model(inputs)`` in the failed one: the
batch is the 64 of that earlier cell, and, while the kernel runs, the rows of ``inputs`` itself. The
finder takes such a tensor as a batch only when the failed cell feeds it whole to a module (a model,
an embedding, a loss module; moved or cast on the way is still whole), and takes the 1-D tensors it
passes beside it with as many rows (the labels) as the same batch. Where the number is written is
traced here: the constructor call that made the tensor, and its dimension, or the variable that
dimension was written with.
"""

from __future__ import annotations

import ast
from typing import Any

from ..cell.source import callable_name, int_constant
from .earlier_cells import path_of
from .knobs import ObjectPath, Trace, Written
from .libraries import class_names
from .provenance import History

# Callables whose arguments give a tensor's shape.
SHAPE_CONSTRUCTORS = frozenset(
    {
        "randn",
        "rand",
        "zeros",
        "ones",
        "empty",
        "full",
        "randint",
        "normal",
        "new_zeros",
        "new_ones",
        "new_empty",
        "new_full",
        "empty_strided",
    }
)
# Methods that move or cast a tensor and keep its rows: ``model(inputs.to(device))`` feeds ``inputs`` whole.
KEEPS_ROWS = frozenset(
    {"to", "cuda", "cpu", "float", "half", "double", "bfloat16", "long", "int", "contiguous", "pin_memory", "detach"}
)


def _elements(node: ast.AST) -> list[ast.AST] | None:
    """A tuple's or list's elements; ``None`` for anything else."""
    return list(node.elts) if isinstance(node, (ast.Tuple, ast.List)) else None


def shape_nodes(call: ast.Call, name: str) -> list[ast.AST]:
    """The nodes giving a constructor's dimensions, in order (``randn(512, 3)``, ``zeros((512, 3))``)."""
    for keyword in call.keywords:
        if keyword.arg == "size" and (elements := _elements(keyword.value)) is not None:
            return elements
    args: list[ast.AST] = list(call.args)
    if name == "randint":
        # randint(high, size) or randint(low, high, size): the shape is the tuple argument.
        return next((elements for elements in map(_elements, args) if elements is not None), [])
    first = _elements(args[0]) if args else None
    if first is not None:
        return first
    if name in {"full", "new_full", "normal", "empty_strided"}:
        return []
    shape: list[ast.AST] = []
    for arg in args:
        if isinstance(arg, ast.Starred):
            break
        shape.append(arg)
    return shape


def whole_tensor(node: ast.expr) -> ast.expr:
    """``inputs.to(device).float()`` -> ``inputs``: the tensor a chain of moves, casts and in-place fills
    (``.bernoulli_(0.3)``, ``.uniform_()``: a method ending in ``_`` keeps the tensor's shape) starts from."""
    while (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and (node.func.attr in KEEPS_ROWS or (node.func.attr.endswith("_") and not node.func.attr.startswith("_")))
    ):
        node = node.func.value
    return node


# Matrix products of two operands, as functions (``torch.mm(a, b)``) or methods (``a.mm(b)``).
MATRIX_PRODUCTS = frozenset({"mm", "matmul", "bmm"})


def contracted_dims(body: list[ast.stmt]) -> dict[str, set[int]]:
    """Names whose dimension a matrix product of the body sums over, counted from the end: ``A @ sketch``
    contracts ``A``'s last dimension (-1) and ``sketch``'s second to last (-2). Such a dimension is a
    matrix's inner size, never a batch (``sketch = torch.randn(4096, 256)`` beside a 4096x4096 ``A``)."""
    contracted: dict[str, set[int]] = {}

    def operand(node: ast.AST, dim: int) -> None:
        node = whole_tensor(node) if isinstance(node, ast.expr) else node
        if isinstance(node, ast.Name):
            contracted.setdefault(node.id, set()).add(dim)

    for node in ast.walk(ast.Module(body=body, type_ignores=[])):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
            operand(node.left, -1)
            operand(node.right, -2)
        elif isinstance(node, ast.Call) and callable_name(node) in MATRIX_PRODUCTS:
            if len(node.args) == 2:
                operand(node.args[0], -1)
                operand(node.args[1], -2)
            elif len(node.args) == 1 and isinstance(node.func, ast.Attribute):
                operand(node.func.value, -1)
                operand(node.args[0], -2)
    return contracted


def matrix_dims(shape: list[ast.AST], contracted: set[int]) -> set[int]:
    """The dimensions of a constructor's shape that are a matrix's, not a batch: the ones a matrix product
    sums over (``contracted``, counted from the end) and both sides of a square matrix (``randn(n, n)``)."""
    dims = {d % len(shape) for d in contracted if -len(shape) <= d < 0}
    if len(shape) == 2 and ast.dump(shape[0]) == ast.dump(shape[1]):
        dims |= {0, 1}
    return dims


def tensor_shape(value: Any) -> tuple[int, ...] | None:
    """The shape of a tensor (not a module's parameter), or ``None`` for anything else."""
    names = class_names(value)
    if "Tensor" not in names or "Parameter" in names or not callable(getattr(value, "narrow", None)):
        return None
    try:
        return tuple(int(n) for n in value.shape)
    except (TypeError, ValueError):
        return None


def trace_rows(history: History, path: ObjectPath, dim: int, rows: int, depth: int = 0) -> Trace:
    """Where the ``rows`` of a tensor at ``path`` were written: the constructor's dimension ``dim`` in the
    cell that made it (``torch.randn(64, ...)``), or the variable it was written with, traced in turn;
    through a tensor it was moved from (``x_gpu = x.cuda()``) too."""
    made = history.cells.assignment(path.root) if not path.steps and depth < 4 else None
    if made is None:
        return Trace((), "made in an earlier cell")
    number, parsed, expression = made
    where = f"In[{number}]" + (f" line {parsed.raw_line(expression)}" if parsed.raw_line(expression) else "")
    call = whole_tensor(expression)
    moved_from = path_of(call) if call is not expression else None
    if moved_from is not None and moved_from != path:
        return trace_rows(history, moved_from, dim, rows, depth + 1)
    name = callable_name(call) if isinstance(call, ast.Call) else ""
    if not isinstance(call, ast.Call) or name not in SHAPE_CONSTRUCTORS:
        return Trace((), f"{where} (not a constructor whose shape is written)")
    shape = shape_nodes(call, name)
    if dim >= len(shape):
        return Trace((), where)
    size = shape[dim]
    if int_constant(size) == rows:
        span = parsed.span(size)
        return Trace((Written(number, span),) if span is not None else (), where)
    named = path_of(size)
    if named is not None:
        followed = history.follow(named, rows)
        return Trace(followed.written, followed.origin, followed.via, (number,) + followed.through)
    return Trace((), f"{where} (computed)")
