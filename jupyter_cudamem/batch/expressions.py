"""Reading expressions: how a body of code uses each value it reads from the namespace.

The walk over one expression, for the body's reader (``reader``): a name or path it reads is recorded
with its use (a tensor's dimension, a slice bound, iterated, printed...), arithmetic carries a batch
through, and a call is handed to ``calls``. Numbers the failed cell writes in a slice, a list
replication or a dict go to its ``CellNumbers``.
"""

from __future__ import annotations

import ast

from ..cell.source import int_constant
from .body import Body
from .calls import CallReader
from .earlier_cells import path_of
from .names import batch_like, name_score
from .reads import CARRIED_THROUGH_ARITHMETIC, CELL_BONUS, Use
from .scope import range_step


class ExpressionReader:
    """The expressions of one body: records into the finding's ``Scan`` what the namespace gives them."""

    def __init__(self, body: Body):
        self.body = body
        self.calls = CallReader(body, self)

    def expr(self, node: ast.AST | None, use: Use, dim: int | None = None) -> None:
        if node is None:
            return
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Load):
                self.record(node, use, dim)
            return
        if isinstance(node, (ast.Attribute, ast.Subscript)):
            self._chain(node, use, dim)
            return
        if isinstance(node, ast.Constant):
            return
        if isinstance(node, ast.Call):
            self.calls.call(node, use)
            return
        if isinstance(node, ast.BinOp):
            self._binop(node, use, dim)
            return
        if isinstance(node, ast.UnaryOp):
            self.expr(node.operand, use if use in CARRIED_THROUGH_ARITHMETIC else Use.OTHER, dim)
            return
        if isinstance(node, (ast.JoinedStr, ast.FormattedValue)):
            for child in ast.iter_child_nodes(node):
                self.expr(child, Use.PRINTED)
            return
        if isinstance(node, ast.IfExp):
            self.expr(node.test, Use.OTHER)
            self.expr(node.body, use, dim)
            self.expr(node.orelse, use, dim)
            return
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            for element in node.elts:
                self.expr(element, use if use in (Use.PRINTED, Use.ITERATED) else Use.OTHER)
            return
        if isinstance(node, ast.Starred):
            self.expr(node.value, use, dim)
            return
        if isinstance(node, ast.Dict):
            self._dict(node, use)
            return
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            self._comprehension(node, use)
            return
        if isinstance(node, ast.Lambda):
            params = {a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs}
            self.body.scope.push(params)
            self.expr(node.body, Use.OTHER)
            self.body.scope.pop()
            return
        for child in ast.iter_child_nodes(node):
            self.expr(child, Use.PRINTED if use is Use.PRINTED else Use.OTHER)

    def record(self, node: ast.AST, use: Use, dim: int | None = None, method: str | None = None) -> bool:
        """Record a read of ``node`` if it reads the namespace (True) or a local of the cell."""
        if use is Use.DIMENSION:
            # Which dimension decides whether it is the batch (``namespace_knobs``); until then it is a use.
            dim, use = (0 if dim is None else dim), Use.OTHER
        path = self.body.scope.namespace_path(node)
        if path is not None:
            read = self.body.scan.read(path)
            read.uses.add(use)
            if dim is not None:
                read.dims.add(dim)
            if method:
                read.methods.add(method)
            if self.body.cell:
                read.direct = True
            elif self.body.function_name:
                read.readers.add(self.body.function_name)
            if use is Use.ITERATED and isinstance(node, ast.expr):
                self.body.follower.follow_iteration(node, path)
            return True
        inner_scopes = self.body.scope.scopes[1:]
        inner = any(isinstance(node, ast.Name) and node.id in names for names in inner_scopes if names)
        if self.body.cell and isinstance(node, ast.Name) and not inner:
            self.body.numbers.local_uses.setdefault(node.id, set()).add(use)
            if dim is not None:
                self.body.numbers.local_dims.setdefault(node.id, set()).add(dim)
        return False

    def _chain(self, node: ast.Attribute | ast.Subscript, use: Use, dim: int | None) -> None:
        path = self.body.scope.namespace_path(node)
        if path is not None:
            self.record(node, use, dim)
        if isinstance(node, ast.Subscript):
            self._subscript(node, use)
        elif path is None:
            self.expr(node.value, Use.PRINTED if use is Use.PRINTED else Use.OTHER)

    def _subscript(self, node: ast.Subscript, use: Use) -> None:
        if path_of(node) is None:
            self.expr(node.value, Use.PRINTED if use is Use.PRINTED else Use.OTHER)
            container = self.body.scope.namespace_path(node.value)
            if container is not None and not isinstance(node.slice, (ast.Slice, ast.Tuple)):
                self.body.scan.read(container).element_uses.add(use)  # ``dataloaders[phase]``: one of its items
        elements = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        for index, element in enumerate(elements):
            if isinstance(element, ast.Slice):
                self._slice(node, element, leading=index == 0, use=use)
            elif not isinstance(element, ast.Constant):
                self.expr(element, Use.PRINTED if use is Use.PRINTED else Use.OTHER)

    def _slice(self, subscript: ast.Subscript, piece: ast.Slice, leading: bool, use: Use) -> None:
        """``texts[:64]``, and ``x[i:i + bs]`` inside ``for i in range(0, n, bs)``: the width of a leading slice
        is a batch. An offset slice elsewhere is a window (``data[i:i + block_size]`` at random ``i``)."""
        if use is Use.PRINTED or not leading:
            for part in (piece.lower, piece.upper, piece.step):
                self.expr(part, Use.PRINTED if use is Use.PRINTED else Use.OTHER)
            return
        lower, upper = piece.lower, piece.upper
        from_start = lower is None or int_constant(lower) == 0
        offset = False
        if isinstance(upper, ast.BinOp) and isinstance(upper.op, ast.Add) and isinstance(lower, ast.Name):
            step = self.body.scope.range_steps.get(lower.id)
            width_node = upper.right if ast.dump(upper.left) == ast.dump(lower) else upper.left
            offset = (
                step is not None
                and ast.dump(width_node) == step
                and (ast.dump(upper.left) == ast.dump(lower) or ast.dump(upper.right) == ast.dump(lower))
            )
        self.expr(lower, Use.OTHER)
        self.expr(piece.step, Use.OTHER)
        if upper is None:
            return
        if from_start or offset:
            width = upper
            if offset:
                assert isinstance(upper, ast.BinOp) and lower is not None
                width = upper.right if ast.dump(upper.left) == ast.dump(lower) else upper.left
            self.expr(width, Use.SLICE)
            if self.body.cell:
                sliced = self.body.scope.namespace_path(subscript.value)
                self.body.numbers.add_use("slice", Use.SLICE, width, "[:{}]", code=subscript, sliced=sliced)
            if offset:
                self.expr(lower, Use.OTHER)
        else:
            self.expr(upper, Use.OTHER)

    def _binop(self, node: ast.BinOp, use: Use, dim: int | None) -> None:
        if isinstance(node.op, ast.MatMult):
            self.expr(node.left, Use.MATMUL)
            self.expr(node.right, Use.MATMUL)
            return
        if isinstance(node.op, ast.Mult):
            for sequence, count in ((node.left, node.right), (node.right, node.left)):
                if isinstance(sequence, ast.List) and len(sequence.elts) == 1:
                    element = sequence.elts[0]
                    if (
                        isinstance(element, ast.Constant)
                        and isinstance(element.value, (int, float, bool))
                        or (isinstance(element, ast.Constant) and element.value is None)
                    ):
                        self.expr(count, Use.OTHER)  # ``[0] * 10``: a per-class accumulator, not a batch
                        return
                    self.expr(element, Use.OTHER)
                    self.expr(count, Use.REPEAT)
                    if self.body.cell:
                        self.body.numbers.add_use("replication", Use.REPEAT, count, "[...] * {}", code=node)
                    return
        carried = use if use in CARRIED_THROUGH_ARITHMETIC else Use.OTHER
        self.expr(node.left, carried, dim)
        self.expr(node.right, carried, dim)

    def _dict(self, node: ast.Dict, use: Use) -> None:
        for key, value in zip(node.keys, node.values):
            if key is not None:
                self.expr(key, Use.OTHER)
            named = isinstance(key, ast.Constant) and isinstance(key.value, str) and batch_like(key.value)
            if named and self.body.cell and int_constant(value) is not None:
                label = str(key.value) if isinstance(key, ast.Constant) else ""
                self.body.numbers.add("dict", label, value, name_score(label) + CELL_BONUS + 1)
            self.expr(value, Use.BATCH_ARGUMENT if named else (Use.PRINTED if use is Use.PRINTED else Use.OTHER))

    def _comprehension(self, node: ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp, use: Use) -> None:
        names: set[str] = set()
        stepped_names = []
        for generator in node.generators:
            self.expr(generator.iter, Use.ITERATED)
            names.update(n.id for n in ast.walk(generator.target) if isinstance(n, ast.Name))
            stepped = range_step(generator.target, generator.iter)
            if stepped:
                self.body.scope.range_steps[stepped[0]] = stepped[1]
                stepped_names.append(stepped[0])
            self.body.scope.push(set(names))
            for condition in generator.ifs:
                self.expr(condition, Use.OTHER)
            self.body.scope.pop()
        self.body.scope.push(names)
        inner = Use.PRINTED if use is Use.PRINTED else Use.OTHER
        if isinstance(node, ast.DictComp):
            self.expr(node.key, inner)
            self.expr(node.value, inner)
        else:
            self.expr(node.elt, inner)
        self.body.scope.pop()
        for name in stepped_names:
            self.body.scope.range_steps.pop(name, None)
