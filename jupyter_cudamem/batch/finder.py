"""Where a failed cell's batch size lives: in its own text, or in what it reads from earlier cells.

The cell is read once (``_Reader``): every name and object path it reads from the namespace, and
how (as a tensor's batch dimension, as a ``batch_size=`` argument, iterated, passed to a call, only
printed...); the same for the notebook functions it calls, through their source in the input
history, with their parameters bound to what the cell passed. Numbers written in the cell are read
with the same eyes. Then each kind of knob is one function over those reads (``_KNOB_READERS``):
an int named or used as a batch, a DataLoader the cell iterates or passes on, a Hugging Face
``Trainer`` it trains or evaluates, ``TrainingArguments`` it passes, a Lightning datamodule or
module it fits, a config it hands to code we cannot read. Each knob is traced to where it was
written (``provenance``), and knobs that are one batch reached two ways (a loader built from
``batch_size``) are merged, so changing one changes all.

Scores rank the knobs; they add up evidence, never tuned to a case:

- what a name says (``names.name_score``: 10 for ``batch_size``, 8 for ``eval_bs``, 0 for ``n``);
- how the value is used (``_USE_SCORES``: passed as a batch size 6, a tensor's batch dimension 5, a
  range step, split size or replication count 4, a slice bound or chunk count 3);
- ``AUTHORITATIVE`` (20) for an object whose batch *is* the batch of what runs: the DataLoader the
  cell iterates, the Trainer it trains, the datamodule it fits;
- +2 for a number written in the cell (the rerun certainly uses it), +1 for a read by the cell
  itself rather than by a function it calls;
- ``PHASE_PENALTY`` (6) for an evaluation batch in a training cell, or the reverse; 5 for an
  evaluation batch where the cell's phase is unclear (an evaluation batch rarely sets a training peak).

A notebook's own classes are read too (``notebook_classes``): a method the cell calls, or the
``__iter__`` of an instance it iterates, with the instance bound to where it lives, and a local that
only renames an attribute (``B, T = self.B, self.T``) read as that attribute; a constructor parameter
the class keeps and uses as a batch (``DataLoaderLite(B=16, T=1024)``) is a batch argument.

What is not a batch: a value only printed or logged, a loop counter (bound by the cell, not read), a
list of zeros (a per-class accumulator), a square or matmul-only matrix, a chunk count whose total
is unknown.
"""

from __future__ import annotations

import ast
import inspect
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ..cell.source import ParsedCell, Transform, callable_name, dotted_name, int_constant, parse_cell
from .earlier_cells import path_of
from .knobs import (
    BatchFinding,
    Default,
    Form,
    Knob,
    KnobKind,
    LiveTarget,
    Loader,
    ObjectPath,
    Rows,
    Step,
    Trace,
    TrainerArgs,
    Value,
    Written,
)
from .libraries import (
    batch_fields,
    found,
    is_config_like,
    is_dataloader,
    is_hf_trainer,
    is_lightning_holder,
    is_module,
    is_training_arguments,
    is_user_class,
    is_user_function,
    lightning_batch_paths,
    loader_batch_size,
    loader_problem,
    resolve,
    sequence_first,
    settable,
)
from .names import batch_like, generation_count, name_score, phase_of
from .notebook_classes import ITERATION_METHODS, kept_parameters, local_aliases, methods
from .provenance import History
from .sequence_first import builds_sequence_first, calls_sequence_first, recurrent_states
from .tensors import SHAPE_CONSTRUCTORS, shape_nodes, tensor_shape, trace_rows, whole_tensor
from .whole import covers_whole_data


class Use(Enum):
    """How code uses a value."""

    DIMENSION = "a tensor's batch dimension"
    BATCH_ARGUMENT = "passed as a batch size"
    GENERATION = "a generation count"
    STEP = "a range step"
    SLICE = "a slice bound"
    SPLIT = "a split size"
    CHUNKS = "a number of chunks"
    REPEAT = "a list replication count"
    STACKED = "the number of items stacked into a tensor"
    ITERATED = "iterated"
    ARGUMENT = "passed to a call"
    MATMUL = "a matrix product operand"
    PRINTED = "printed"
    OTHER = "used"


_USE_SCORES = {
    Use.BATCH_ARGUMENT: 6,
    Use.DIMENSION: 5,
    Use.GENERATION: 4,
    Use.STEP: 4,
    Use.SPLIT: 4,
    Use.REPEAT: 4,
    Use.STACKED: 4,
    Use.SLICE: 3,
    Use.CHUNKS: 3,
}
# Arithmetic on a batch is still a batch (``batch_size * 2`` passed as a batch size, ``i + bs`` as a slice bound).
_CARRIED_THROUGH_ARITHMETIC = {Use.DIMENSION, Use.BATCH_ARGUMENT, Use.STEP, Use.SLICE, Use.SPLIT, Use.GENERATION}
AUTHORITATIVE = 20
CELL_BONUS = 2
DIRECT_BONUS = 1
PHASE_PENALTY = 6
UNCLEAR_EVAL_PENALTY = 5
_MAX_FUNCTION_DEPTH = 3
# Dimensions of a recurrent state ``(layers, batch, hidden)``, recorded as such: its batch whatever the
# input's batch dimension is, and its layers, never a batch.
_STATE_BATCH = -1
_STATE_LAYERS = -2

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
_TRAIN_METHODS = {"train", "fit", "backward", "train_step", "training_step"}
_EVAL_METHODS = {"evaluate", "predict", "validate", "test", "eval", "generate", "predict_step"}


@dataclass
class _Read:
    """How the cell (and the functions it calls) read one path of the namespace."""

    uses: set[Use] = field(default_factory=set)
    dims: set[int] = field(default_factory=set)  # tensor dimensions it gives
    methods: set[str] = field(default_factory=set)  # methods called on it
    direct: bool = False  # read by the cell itself
    readers: set[str] = field(default_factory=set)  # notebook functions that read it
    opaque_argument: bool = False  # passed to a call whose code we cannot read
    called: bool = False  # called itself (a model, a function)
    element_uses: set[Use] = field(default_factory=set)  # uses of its items taken by a computed key (loaders[phase])
    fed: bool = False  # passed whole by the cell to a module (``model(inputs.to(device))``)


@dataclass
class _Literal:
    """A number written in the failed cell that may be its batch."""

    form: Form
    label: str
    value: int
    nodes: list[ast.AST]
    score: int
    evidence: tuple[str, ...] = ()
    sliced: ObjectPath | None = None  # for a slice: what is sliced
    total: int | None = None  # for a chunk count: the size chunked


@dataclass
class _Constructor:
    """A tensor constructor with a literal shape in the cell."""

    call: ast.Call
    shape: list[ast.AST]
    assigned_to: str | None


class _Scan:
    """Everything read in one finding: shared by the cell's reader and those of the functions it calls."""

    def __init__(self, namespace: Mapping[str, Any], history: History, transform: Transform | None):
        self.namespace = namespace
        self.history = history
        self.transform = transform
        self.reads: dict[ObjectPath, _Read] = {}
        self.defaults: list[tuple[ObjectPath, str, int, set[Use]]] = []  # (function, parameter, value, uses)
        self.analysed: set[tuple[int, tuple[tuple[str, ObjectPath | None], ...]]] = set()
        self.trains = False
        self.states: set[str] = set()  # names the cell passes as an RNN's hidden state (``recurrent_states``)
        self.evaluates = False

    def read(self, path: ObjectPath) -> _Read:
        return self.reads.setdefault(path, _Read())

    @property
    def phase(self) -> str | None:
        if self.trains:
            return "train"
        return "eval" if self.evaluates else None


class _Reader:
    """Reads one body of code: the failed cell (``cell=True``) or a notebook function it calls."""

    def __init__(
        self,
        scan: _Scan,
        parsed: ParsedCell | None,
        cell: bool,
        bindings: dict[str, ObjectPath | None] | None = None,
        local_names: set[str] | None = None,
        function_name: str | None = None,
        depth: int = 0,
    ):
        self.scan = scan
        self.parsed = parsed
        self.cell = cell
        self.bindings = bindings or {}
        self.local_names = local_names or set()
        self.function_name = function_name
        self.depth = depth
        self.bound_at: dict[str, int] = {}  # cell: first line binding each name
        self.scopes: list[set[str]] = []  # comprehension and lambda variables
        # The cell's own names and numbers.
        self.local_uses: dict[str, set[Use]] = {}
        self.local_dims: dict[str, set[int]] = {}
        self.assigned: dict[str, list[ast.expr]] = {}
        self.literals: list[_Literal] = []
        self.constructors: list[_Constructor] = []
        self.functions_defined: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}
        self._assigning: str | None = None
        self._range_steps: dict[str, str] = {}  # loop variable of ``range(a, b, step)`` -> the step, dumped

    # -- names ----------------------------------------------------------------------------------------
    def _is_local(self, name: str, node: ast.AST) -> bool:
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
        return self.bound_at.get(name) == getattr(node, "lineno", -1) and name not in self._loop_targets

    def _namespace_path(self, node: ast.AST) -> ObjectPath | None:
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
        if self._is_local(path.root, root):
            return None
        if path.root not in self.scan.namespace:
            return None
        return path

    def _record(self, node: ast.AST, use: Use, dim: int | None = None, method: str | None = None) -> bool:
        """Record a read of ``node`` if it reads the namespace (True) or a local of the cell."""
        if use is Use.DIMENSION:
            # Which dimension decides whether it is the batch (see ``_batch_uses``); until then it is a use.
            dim, use = (0 if dim is None else dim), Use.OTHER
        path = self._namespace_path(node)
        if path is not None:
            read = self.scan.read(path)
            read.uses.add(use)
            if dim is not None:
                read.dims.add(dim)
            if method:
                read.methods.add(method)
            if self.cell:
                read.direct = True
            elif self.function_name:
                read.readers.add(self.function_name)
            if use is Use.ITERATED and isinstance(node, ast.expr):
                self._follow_iteration(node, path)
            return True
        if self.cell and isinstance(node, ast.Name) and not any(node.id in scope for scope in self.scopes[1:] if scope):
            self.local_uses.setdefault(node.id, set()).add(use)
            if dim is not None:
                self.local_dims.setdefault(node.id, set()).add(dim)
        return False

    # -- statements -----------------------------------------------------------------------------------
    def read_body(self, body: list[ast.stmt]) -> None:
        if self.cell:
            self._loop_targets: set[str] = set()
            self._collect_bindings(body)
        else:
            self._loop_targets = set()
            for name, value in local_aliases(body):  # ``B, T = self.B, self.T``: B is self.B
                path = self._namespace_path(value)
                if path is not None and name not in self.bindings:
                    self.bindings[name] = path
        for statement in body:
            self._statement(statement)

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
                self._loop_targets.update(n.id for n in ast.walk(node.target) if isinstance(n, ast.Name))
            for name, line in names:
                self.bound_at[name] = min(self.bound_at.get(name, line), line)
        # Names bound inside comprehensions or nested functions do not count: they are scoped there.
        for node in ast.walk(ast.Module(body=body, type_ignores=[])):
            if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
                for generator in node.generators:
                    for name in (n.id for n in ast.walk(generator.target) if isinstance(n, ast.Name)):
                        if not _bound_outside(body, name, generator.target):
                            self.bound_at.pop(name, None)

    def _statement(self, node: ast.stmt) -> None:
        if isinstance(node, ast.Assign):
            self._assignment(node.targets, node.value)
        elif isinstance(node, ast.AnnAssign):
            if node.value is not None:
                self._assignment([node.target], node.value)
        elif isinstance(node, ast.AugAssign):
            self._expr(node.target, Use.OTHER)
            self._expr(node.value, Use.OTHER)
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            self._expr(node.iter, Use.ITERATED)
            stepped = _range_step(node.target, node.iter)
            if stepped:
                self._range_steps[stepped[0]] = stepped[1]
            for statement in node.body + node.orelse:
                self._statement(statement)
            if stepped:
                self._range_steps.pop(stepped[0], None)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                context = item.context_expr
                name = callable_name(context) if isinstance(context, ast.Call) else ""
                if name in ("no_grad", "inference_mode"):
                    self.scan.evaluates = True
                self._expr(context, Use.OTHER)
            for statement in node.body:
                self._statement(statement)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            self._function_definition(node)
        elif isinstance(node, ast.ClassDef):
            self._class_definition(node)
        elif isinstance(node, (ast.Expr, ast.Return)):
            if node.value is not None:
                self._expr(node.value, Use.OTHER)
        elif isinstance(node, ast.Assert):
            self._expr(node.test, Use.PRINTED)
        elif isinstance(
            node, (ast.Import, ast.ImportFrom, ast.Global, ast.Nonlocal, ast.Pass, ast.Break, ast.Continue)
        ):
            return
        else:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    self._statement(child)
                elif isinstance(child, ast.expr):
                    self._expr(child, Use.OTHER)
                elif isinstance(child, ast.ExceptHandler):
                    for statement in child.body:
                        self._statement(statement)

    def _assignment(self, targets: list[ast.expr], value: ast.expr) -> None:
        for target in targets:
            self._target(target, value)
        single = targets[0] if len(targets) == 1 else None
        self._assigning = single.id if isinstance(single, ast.Name) else None
        try:
            self._expr(value, Use.OTHER)
        finally:
            self._assigning = None
        for target in targets:
            if isinstance(target, (ast.Attribute, ast.Subscript)):
                self._expr(target.value, Use.OTHER)

    def _target(self, target: ast.expr, value: ast.expr) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts):
                for sub_target, sub_value in zip(target.elts, value.elts):
                    self._target(sub_target, sub_value)
            return
        literal = int_constant(value)
        if not self.cell or literal is None:
            return
        if isinstance(target, ast.Name):
            self.assigned.setdefault(target.id, []).append(value)
        elif isinstance(target, (ast.Attribute, ast.Subscript)):
            path = path_of(target)
            if path is not None and path.steps and batch_like(path.last_name):
                self._add_literal("assignment", path.text, value, name_score(path.last_name) + CELL_BONUS)

    def _function_definition(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        """A function defined in the failed cell: its defaults are the cell's numbers, its body the cell's code."""
        if not self.cell:
            return
        self.functions_defined[node.name] = node
        for default in node.args.defaults + [d for d in node.args.kw_defaults if d is not None]:
            self._expr(default, Use.OTHER)
        parameters = {a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs}
        self.scopes.append(parameters | _assigned_in(node.body))
        for statement in node.body:
            self._statement(statement)
        self.scopes.pop()
        for parameter, default in _parameter_defaults(node):
            value = int_constant(default)
            if value is None:
                continue
            uses = _uses_in(node.body, parameter)
            evidence_score = max((_USE_SCORES.get(u, 0) for u in uses), default=0)
            if batch_like(parameter) or evidence_score:
                self._add_literal(
                    "default",
                    parameter,
                    default,
                    name_score(parameter) + evidence_score + CELL_BONUS,
                    tuple(u.value for u in uses if u in _USE_SCORES),
                )

    def _class_definition(self, node: ast.ClassDef) -> None:
        for item in node.body:
            if self.cell and isinstance(item, (ast.Assign, ast.AnnAssign)):
                targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                for target in targets:
                    if isinstance(target, ast.Name) and batch_like(target.id) and item.value is not None:
                        self._add_literal(
                            "assignment",
                            f"{node.name}.{target.id}",
                            item.value,
                            name_score(target.id) + CELL_BONUS,
                        )
            elif isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self._function_definition(item)

    # -- expressions ----------------------------------------------------------------------------------
    def _expr(self, node: ast.AST | None, use: Use, dim: int | None = None) -> None:
        if node is None:
            return
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Load):
                self._record(node, use, dim)
            return
        if isinstance(node, (ast.Attribute, ast.Subscript)):
            self._chain(node, use, dim)
            return
        if isinstance(node, ast.Constant):
            return
        if isinstance(node, ast.Call):
            self._call(node, use)
            return
        if isinstance(node, ast.BinOp):
            self._binop(node, use, dim)
            return
        if isinstance(node, ast.UnaryOp):
            self._expr(node.operand, use if use in _CARRIED_THROUGH_ARITHMETIC else Use.OTHER, dim)
            return
        if isinstance(node, (ast.JoinedStr, ast.FormattedValue)):
            for child in ast.iter_child_nodes(node):
                self._expr(child, Use.PRINTED)
            return
        if isinstance(node, ast.IfExp):
            self._expr(node.test, Use.OTHER)
            self._expr(node.body, use, dim)
            self._expr(node.orelse, use, dim)
            return
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            for element in node.elts:
                self._expr(element, use if use in (Use.PRINTED, Use.ITERATED) else Use.OTHER)
            return
        if isinstance(node, ast.Starred):
            self._expr(node.value, use, dim)
            return
        if isinstance(node, ast.Dict):
            self._dict(node, use)
            return
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            self._comprehension(node, use)
            return
        if isinstance(node, ast.Lambda):
            params = {a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs}
            self.scopes.append(params)
            self._expr(node.body, Use.OTHER)
            self.scopes.pop()
            return
        for child in ast.iter_child_nodes(node):
            self._expr(child, Use.PRINTED if use is Use.PRINTED else Use.OTHER)

    def _chain(self, node: ast.Attribute | ast.Subscript, use: Use, dim: int | None) -> None:
        path = self._namespace_path(node)
        if path is not None:
            self._record(node, use, dim)
        if isinstance(node, ast.Subscript):
            self._subscript(node, use)
        elif path is None:
            self._expr(node.value, Use.PRINTED if use is Use.PRINTED else Use.OTHER)

    def _subscript(self, node: ast.Subscript, use: Use) -> None:
        if path_of(node) is None:
            self._expr(node.value, Use.PRINTED if use is Use.PRINTED else Use.OTHER)
            container = self._namespace_path(node.value)
            if container is not None and not isinstance(node.slice, (ast.Slice, ast.Tuple)):
                self.scan.read(container).element_uses.add(use)  # ``dataloaders[phase]``: one of its items
        elements = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        for index, element in enumerate(elements):
            if isinstance(element, ast.Slice):
                self._slice(node, element, leading=index == 0, use=use)
            elif not isinstance(element, ast.Constant):
                self._expr(element, Use.PRINTED if use is Use.PRINTED else Use.OTHER)

    def _slice(self, subscript: ast.Subscript, piece: ast.Slice, leading: bool, use: Use) -> None:
        """``texts[:64]``, and ``x[i:i + bs]`` inside ``for i in range(0, n, bs)``: the width of a leading slice
        is a batch. An offset slice elsewhere is a window (``data[i:i + block_size]`` at random ``i``)."""
        if use is Use.PRINTED or not leading:
            for part in (piece.lower, piece.upper, piece.step):
                self._expr(part, Use.PRINTED if use is Use.PRINTED else Use.OTHER)
            return
        lower, upper = piece.lower, piece.upper
        from_start = lower is None or int_constant(lower) == 0
        offset = False
        if isinstance(upper, ast.BinOp) and isinstance(upper.op, ast.Add) and isinstance(lower, ast.Name):
            step = self._range_steps.get(lower.id)
            width_node = upper.right if ast.dump(upper.left) == ast.dump(lower) else upper.left
            offset = (
                step is not None
                and ast.dump(width_node) == step
                and (ast.dump(upper.left) == ast.dump(lower) or ast.dump(upper.right) == ast.dump(lower))
            )
        self._expr(lower, Use.OTHER)
        self._expr(piece.step, Use.OTHER)
        if upper is None:
            return
        if from_start or offset:
            width = upper
            if offset:
                assert isinstance(upper, ast.BinOp) and lower is not None
                width = upper.right if ast.dump(upper.left) == ast.dump(lower) else upper.left
            self._expr(width, Use.SLICE)
            value = int_constant(width)
            if self.cell and value is not None and value >= 2:
                sliced = self._namespace_path(subscript.value)
                label = self._text(subscript) or f"[:{value}]"
                self._add_literal(
                    "slice",
                    label,
                    width,
                    _USE_SCORES[Use.SLICE] + CELL_BONUS,
                    (Use.SLICE.value,),
                    sliced=sliced,
                )
            if offset:
                self._expr(lower, Use.OTHER)
        else:
            self._expr(upper, Use.OTHER)

    def _binop(self, node: ast.BinOp, use: Use, dim: int | None) -> None:
        if isinstance(node.op, ast.MatMult):
            self._expr(node.left, Use.MATMUL)
            self._expr(node.right, Use.MATMUL)
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
                        self._expr(count, Use.OTHER)  # ``[0] * 10``: a per-class accumulator, not a batch
                        return
                    self._expr(element, Use.OTHER)
                    self._expr(count, Use.REPEAT)
                    value = int_constant(count)
                    if self.cell and value is not None and value >= 2:
                        self._add_literal(
                            "replication",
                            self._text(node) or f"[...] * {value}",
                            count,
                            _USE_SCORES[Use.REPEAT] + CELL_BONUS,
                            (Use.REPEAT.value,),
                        )
                    return
        carried = use if use in _CARRIED_THROUGH_ARITHMETIC else Use.OTHER
        self._expr(node.left, carried, dim)
        self._expr(node.right, carried, dim)

    def _dict(self, node: ast.Dict, use: Use) -> None:
        for key, value in zip(node.keys, node.values):
            if key is not None:
                self._expr(key, Use.OTHER)
            named = isinstance(key, ast.Constant) and isinstance(key.value, str) and batch_like(key.value)
            if named and self.cell and int_constant(value) is not None:
                label = str(key.value) if isinstance(key, ast.Constant) else ""
                self._add_literal("dict", label, value, name_score(label) + CELL_BONUS + 1)
            self._expr(value, Use.BATCH_ARGUMENT if named else (Use.PRINTED if use is Use.PRINTED else Use.OTHER))

    def _comprehension(self, node: ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp, use: Use) -> None:
        names: set[str] = set()
        stepped_names = []
        for generator in node.generators:
            self._expr(generator.iter, Use.ITERATED)
            names.update(n.id for n in ast.walk(generator.target) if isinstance(n, ast.Name))
            stepped = _range_step(generator.target, generator.iter)
            if stepped:
                self._range_steps[stepped[0]] = stepped[1]
                stepped_names.append(stepped[0])
            self.scopes.append(set(names))
            for condition in generator.ifs:
                self._expr(condition, Use.OTHER)
            self.scopes.pop()
        self.scopes.append(names)
        inner = Use.PRINTED if use is Use.PRINTED else Use.OTHER
        if isinstance(node, ast.DictComp):
            self._expr(node.key, inner)
            self._expr(node.value, inner)
        else:
            self._expr(node.elt, inner)
        self.scopes.pop()
        for name in stepped_names:
            self._range_steps.pop(name, None)

    # -- calls --------------------------------------------------------------------------------------
    def _call(self, node: ast.Call, use: Use) -> None:
        name = callable_name(node)
        dotted = dotted_name(node.func) or ""
        function = node.func
        if use is Use.PRINTED or _prints(node, name, dotted):
            for child in node.args + [k.value for k in node.keywords]:
                self._expr(child, Use.PRINTED)
            if isinstance(function, ast.Attribute):
                self._expr(function.value, Use.PRINTED)
            return
        self._phase(node, name)
        # What is called.
        if isinstance(function, ast.Attribute):
            receiver = self._namespace_path(function.value)
            if receiver is not None:
                self._record(function.value, Use.OTHER, method=name)
            else:
                self._expr(function.value, Use.OTHER)
        elif isinstance(function, ast.Name):
            callee = self._namespace_path(function)
            if callee is not None:
                self.scan.read(callee).called = True
                self._record(function, Use.OTHER)
        else:
            self._expr(function, Use.OTHER)
        # Its arguments.
        if name in SHAPE_CONSTRUCTORS and (
            dotted.startswith(("torch.", "np.", "numpy.")) or isinstance(function, ast.Attribute)
        ):
            self._shape_call(node, name)
            return
        if name in _RESHAPES and isinstance(function, ast.Attribute):
            for index, argument in enumerate(node.args):
                self._expr(argument, Use.DIMENSION if index == 0 else Use.OTHER, index)
            return
        if name in _INSPECTORS:
            for argument in node.args:
                self._expr(argument, Use.OTHER)
            return
        if name in _MATMULS:
            for argument in node.args:
                self._expr(argument, Use.MATMUL)
            return
        if name == "range" and len(node.args) == 3:
            self._expr(node.args[0], Use.OTHER)
            self._expr(node.args[1], Use.OTHER)
            self._expr(node.args[2], Use.STEP)
            value = int_constant(node.args[2])
            if self.cell and value is not None and value >= 2:
                self._add_literal(
                    "range step",
                    self._text(node) or f"range(..., {value})",
                    node.args[2],
                    _USE_SCORES[Use.STEP] + CELL_BONUS,
                    (Use.STEP.value,),
                )
            return
        if name in ("split", "chunk", "array_split", "tensor_split") and self._size_call(node, name, dotted):
            return
        if name in _STACKERS and node.args and isinstance(node.args[0], (ast.ListComp, ast.GeneratorExp)):
            self._stacked_count(node.args[0])
        if name in _ITERATION_WRAPPERS:
            iterate = use is Use.ITERATED or name in ("iter", "next")
            for argument in node.args:
                self._expr(argument, Use.ITERATED if iterate else Use.ARGUMENT)
            for keyword in node.keywords:
                self._expr(keyword.value, Use.OTHER)
            return
        self._arguments(node, name)

    def _phase(self, node: ast.Call, name: str) -> None:
        if name in ("backward", "fit", "zero_grad") or (name == "train" and not node.args and not node.keywords):
            self.scan.trains = True
        elif name in ("step",) and isinstance(node.func, ast.Attribute):
            receiver = dotted_name(node.func.value) or ""
            if any(word in receiver.lower() for word in ("optim", "opt", "scaler")):
                self.scan.trains = True
        elif name in ("evaluate", "predict", "validate", "test", "eval", "generate"):
            self.scan.evaluates = True

    def _shape_call(self, node: ast.Call, name: str) -> None:
        shape = shape_nodes(node, name)
        shape_ids = {id(n) for n in shape}
        state = self.cell and self._assigning in self.scan.states and len(shape) == 3
        for index, dimension in enumerate(shape):
            dim = (_STATE_BATCH if index == 1 else _STATE_LAYERS if index == 0 else index) if state else index
            self._expr(dimension, Use.DIMENSION, dim)
        for argument in node.args:
            if id(argument) not in shape_ids and not (
                isinstance(argument, (ast.Tuple, ast.List)) and any(id(e) in shape_ids for e in argument.elts)
            ):
                self._expr(argument, Use.OTHER)
        for keyword in node.keywords:
            if not (keyword.arg == "size" and isinstance(keyword.value, (ast.Tuple, ast.List))):
                self._expr(keyword.value, Use.OTHER)
        if self.cell and shape and any(int_constant(n) is not None for n in shape):
            self.constructors.append(_Constructor(node, shape, self._assigning))

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
        self._expr(receiver, Use.OTHER)
        self._expr(size, Use.CHUNKS if counts else Use.SPLIT)
        for extra in arguments[1:] + [k.value for k in node.keywords]:
            self._expr(extra, Use.OTHER)
        value = int_constant(size)
        if self.cell and value is not None and value >= 2:
            label = self._text(node) or f"{name}({value})"
            if counts:
                chunked = self._namespace_path(receiver) if receiver is not None else None
                total = _leading_size(resolve(self.scan.namespace, chunked)) if chunked is not None else None
                if total:
                    self._add_literal(
                        "chunks",
                        label,
                        size,
                        _USE_SCORES[Use.CHUNKS] + CELL_BONUS,
                        (Use.CHUNKS.value,),
                        total=total,
                    )
            else:
                self._add_literal("split", label, size, _USE_SCORES[Use.SPLIT] + CELL_BONUS, (Use.SPLIT.value,))
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
        self._expr(count, Use.STACKED)
        value = int_constant(count)
        if self.cell and value is not None and value >= 2:
            self._add_literal(
                "count",
                self._text(iterable) or f"range({value})",
                count,
                _USE_SCORES[Use.STACKED] + CELL_BONUS,
                (Use.STACKED.value,),
            )

    def _arguments(self, node: ast.Call, name: str) -> None:
        callee = self._callee(node)
        parameters = _positional_parameters(callee, name)
        readable = is_user_function(callee) or (inspect.ismethod(callee) and is_user_class(type(callee.__self__)))
        opaque = not readable and name not in self.functions_defined
        # A model's constructor takes sizes of the model (layers, a context length), not a batch.
        kept = self._kept_uses(callee) if is_user_class(callee) and not is_module(callee) else {}
        if self.cell and is_module(self._module_called(node, callee)):
            for argument in node.args + [k.value for k in node.keywords]:
                fed = self._namespace_path(whole_tensor(argument))
                if fed is not None:
                    self.scan.read(fed).fed = True
        for index, argument in enumerate(node.args):
            parameter = parameters[index] if index < len(parameters) else None
            self._argument(argument, parameter, opaque, kept.get(parameter or ""))
        for keyword in node.keywords:
            self._argument(keyword.value, keyword.arg, opaque, kept.get(keyword.arg or ""))
        if callee is not None and self.depth < _MAX_FUNCTION_DEPTH:
            self._follow_call(node, callee)

    def _argument(self, argument: ast.expr, parameter: str | None, opaque: bool, kept: Use | None = None) -> None:
        if parameter and kept is not None and not batch_like(parameter):
            # ``DataLoaderLite(B=16, T=1024)``: the class keeps B and uses it as a batch in a method.
            self._expr(argument, kept, 0 if kept is Use.DIMENSION else None)
            if self.cell:
                score = _USE_SCORES[kept] + CELL_BONUS
                self._add_literal("keyword", parameter, argument, score, (f"{kept.value} in the class",))
            return
        if parameter and batch_like(parameter):
            use = Use.GENERATION if generation_count(parameter) else Use.BATCH_ARGUMENT
            self._expr(argument, use)
            value = int_constant(argument)
            if self.cell and value is not None and value >= 2:
                bonus = 1 if parameter in ("batch_size",) else 0
                score = name_score(parameter) + _USE_SCORES[use] + CELL_BONUS + bonus
                self._add_literal("keyword", parameter, argument, score, (use.value,))
            return
        path = self._namespace_path(argument)
        if path is not None:
            self._record(argument, Use.ARGUMENT)
            if opaque:
                self.scan.read(path).opaque_argument = True
            return
        self._expr(argument, Use.OTHER)

    def _callee(self, node: ast.Call) -> Any:
        path = self._namespace_path(node.func)
        if path is None:
            return None
        value = resolve(self.scan.namespace, path)
        return value if found(value) else None

    def _module_called(self, node: ast.Call, callee: Any) -> Any:
        """What the cell calls: from the namespace, or, for a name the cell bound before the call, what it
        held when the cell failed (the model it built)."""
        if callee is not None or not isinstance(node.func, ast.Name) or node.func.id not in self.bound_at:
            return callee
        return self.scan.namespace.get(node.func.id)

    def _kept_uses(self, cls: type) -> dict[str, Use]:
        """A notebook class's constructor parameters that its methods use as a batch, each with its best use."""
        defined = self.scan.history.cells.definition(cls.__name__)
        if defined is None or not isinstance(defined[2], ast.ClassDef):
            return {}
        return _class_batch_parameters(defined[2])

    def _follow_iteration(self, iterable: ast.expr, path: ObjectPath) -> None:
        """``for xb, yb in train_dl`` over an instance of a notebook class: read its ``__iter__``."""
        if self.depth >= _MAX_FUNCTION_DEPTH:
            return
        value = resolve(self.scan.namespace, path)
        if not found(value) or not is_user_class(type(value)):
            return
        for method_name in ITERATION_METHODS:
            method = getattr(value, method_name, None)
            if inspect.ismethod(method):
                receiver = ast.Attribute(value=iterable, attr=method_name, ctx=ast.Load())
                self._follow_call(ast.Call(func=receiver, args=[], keywords=[]), method)

    # -- functions the cell calls -------------------------------------------------------------------
    def _follow_call(self, node: ast.Call, callee: Any) -> None:
        """Read a notebook function (or a method of a notebook class) the code calls, with its parameters
        bound to the namespace paths the call passes."""
        self_path: ObjectPath | None = None
        function = callee
        if inspect.ismethod(callee) and is_user_class(type(callee.__self__)):
            self_path = self._namespace_path(node.func.value) if isinstance(node.func, ast.Attribute) else None
            function = callee.__func__
        if not is_user_function(function):
            return
        defined = self._definition_of(function)
        if defined is None:
            return
        _, parsed, definition = defined
        bindings: dict[str, ObjectPath | None] = {}
        try:
            signature = inspect.signature(function)
            arguments: list[Any] = ([None] if self_path is not None or inspect.ismethod(callee) else []) + list(
                node.args
            )
            if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
                raise TypeError
            bound = signature.bind_partial(*arguments, **{k.arg: k.value for k in node.keywords if k.arg})
        except (TypeError, ValueError):
            return
        parameters = list(signature.parameters)
        for parameter in parameters:
            bindings[parameter] = None
        if inspect.ismethod(callee) and parameters:
            bindings[parameters[0]] = self_path
        for parameter, argument in bound.arguments.items():
            if isinstance(argument, ast.AST):
                bindings[parameter] = self._namespace_path(argument)
        key = (id(definition), tuple(sorted((k, v) for k, v in bindings.items() if v is not None)))
        if key in self.scan.analysed:
            return
        self.scan.analysed.add(key)
        reader = _Reader(
            self.scan,
            parsed,
            cell=False,
            bindings=bindings,
            local_names=set(parameters) | _assigned_in(definition.body) - _globals_in(definition.body),
            function_name=function.__name__,
            depth=self.depth + 1,
        )
        reader.read_body(definition.body)
        if self_path is None:
            function_path = self._namespace_path(node.func)
            if function_path is not None:
                for declared in signature.parameters.values():
                    default = declared.default
                    if declared.name in bound.arguments or type(default) is not int or default < 2:
                        continue
                    uses = _uses_in(definition.body, declared.name)
                    if batch_like(declared.name) or any(u in _USE_SCORES for u in uses):
                        self.scan.defaults.append((function_path, declared.name, default, uses))

    def _definition_of(self, function: Any) -> tuple[int, ParsedCell, ast.FunctionDef | ast.AsyncFunctionDef] | None:
        qualified = getattr(function, "__qualname__", function.__name__).split(".")
        defined = self.scan.history.cells.definition(qualified[0])
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

    # -- numbers in the cell --------------------------------------------------------------------------
    def _text(self, node: ast.AST) -> str | None:
        if self.parsed is None:
            return None
        span = self.parsed.span(node)
        text = self.parsed.text(span) if span is not None else None
        return text if text is None or len(text) <= 60 else text[:59] + "…"

    def _add_literal(
        self,
        form: Form,
        label: str,
        node: ast.AST,
        score: int,
        evidence: tuple[str, ...] = (),
        sliced: ObjectPath | None = None,
        total: int | None = None,
    ) -> None:
        value = int_constant(node)
        if value is None or value < 2 or self.parsed is None or self.parsed.span(node) is None:
            return
        batch = math.ceil(total / value) if total else value
        self.literals.append(_Literal(form, label, batch, [node], score, evidence, sliced, total))


# -- reading helpers ------------------------------------------------------------------------------------
def _range_step(target: ast.AST, iterable: ast.AST) -> tuple[str, str] | None:
    """``for i in range(0, n, step)``: (``i``, the step dumped), for matching ``x[i:i + step]``."""
    if (
        isinstance(target, ast.Name)
        and isinstance(iterable, ast.Call)
        and callable_name(iterable) == "range"
        and len(iterable.args) == 3
    ):
        return target.id, ast.dump(iterable.args[2])
    return None


def _prints(node: ast.Call, name: str, dotted: str) -> bool:
    """``print(...)``, ``logger.info(...)``, ``pbar.set_postfix(...)``, ``"{}".format(...)``: output only."""
    if isinstance(node.func, ast.Name):
        return name in _PRINT_FUNCTIONS
    if name in _PRINT_METHODS:
        return True
    return name in _MAYBE_PRINT_METHODS and dotted.split(".")[0] not in _MATH_MODULES


def _assigned_in(body: list[ast.stmt]) -> set[str]:
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


def _globals_in(body: list[ast.stmt]) -> set[str]:
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


def _parameter_defaults(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[tuple[str, ast.expr]]:
    args = node.args
    positional = args.posonlyargs + args.args
    pairs = [(a.arg, d) for a, d in zip(positional[len(positional) - len(args.defaults) :], args.defaults)]
    pairs += [(a.arg, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
    return pairs


def _uses_in(body: list[ast.stmt], name: str) -> set[Use]:
    """How a function body uses one of its parameters."""
    scan = _Scan({name: None}, History([], 0, {}), None)
    probe = _Reader(
        scan, None, cell=False, bindings={name: ObjectPath(name)}, local_names={name}, depth=_MAX_FUNCTION_DEPTH
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
        scan = _Scan({self_name: None}, History([], 0, {}), None)
        probe = _Reader(
            scan,
            None,
            cell=False,
            bindings={self_name: ObjectPath(self_name)},
            local_names={a.arg for a in arguments} | _assigned_in(method.body),
            depth=_MAX_FUNCTION_DEPTH,
        )
        probe.read_body(method.body)
        for path, read in scan.reads.items():
            if path.root == self_name and len(path.steps) == 1 and not path.steps[0].key:
                uses = set(read.uses) | ({Use.DIMENSION} if 0 in read.dims else set())
                attribute_uses.setdefault(str(path.steps[0].name), set()).update(uses)
    batch_parameters = {}
    for parameter, attributes in kept.items():
        uses = {u for attribute in attributes for u in attribute_uses.get(attribute, set()) if u in _USE_SCORES}
        if uses:
            batch_parameters[parameter] = max(uses, key=lambda u: (_USE_SCORES[u], u.value))
    return batch_parameters


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


def _leading_size(value: Any) -> int | None:
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


# -- from reads to knobs ---------------------------------------------------------------------------------
@dataclass
class _Context:
    scan: _Scan
    batch_dimension: int  # 0, or 1 for a cell feeding a sequence-first model


def _evidence(read: _Read, uses: Iterable[Use]) -> tuple[str, ...]:
    evidence = tuple(u.value for u in sorted(uses, key=lambda u: -_USE_SCORES.get(u, 0)) if u in _USE_SCORES)
    if not read.direct and read.readers:
        evidence += (f"read by {', '.join(sorted(read.readers))}()",)
    return evidence


def _batch_uses(read: _Read, context: _Context) -> set[Use]:
    uses = set(read.uses) - {Use.PRINTED, Use.OTHER, Use.MATMUL}
    if context.batch_dimension in read.dims or _STATE_BATCH in read.dims:
        uses.add(Use.DIMENSION)
    return uses


def _phase_penalty(text: str, context: _Context) -> int:
    knob_phase = phase_of(text)
    cell_phase = context.scan.phase
    if knob_phase is None:
        return 0
    if cell_phase is None:
        return UNCLEAR_EVAL_PENALTY if knob_phase == "eval" else 0
    return PHASE_PENALTY if knob_phase != cell_phase else 0


def _traced(context: _Context, path: ObjectPath, value: int) -> Trace:
    trace = context.scan.history.trace(path, value)
    return trace if trace is not None else Trace((), "set in an earlier cell")


def _via(trace: Trace, context: _Context) -> tuple[LiveTarget, ...]:
    """The places a traced value passed through, as places to change: a loader's ``batch_size`` is changed
    by rebuilding the loader, anything else by setting it."""
    targets: list[LiveTarget] = []
    for path in trace.via:
        parent = ObjectPath(path.root, path.steps[:-1]) if path.steps else None
        if (
            parent is not None
            and path.last_name == "batch_size"
            and is_dataloader(resolve(context.scan.namespace, parent))
        ):
            targets.append(Loader(parent))
        else:
            targets.append(Value(path))
    return tuple(targets)


def _integer(path: ObjectPath, value: Any, read: _Read, context: _Context) -> list[Knob]:
    """An int the cell reads, named or used as a batch: a variable, or a field of a config."""
    if type(value) is not int or value < 2:
        return []
    uses = {u for u in _batch_uses(read, context) if u in _USE_SCORES}  # iterated or passed on says nothing of an int
    named = name_score(path.last_name)
    if not named and not uses:
        return []
    if read.uses <= {Use.PRINTED}:
        return []  # only printed or logged: changing it changes no memory
    if path.steps:
        parent = resolve(context.scan.namespace, ObjectPath(path.root, path.steps[:-1]))
        if not settable(parent, path.steps[-1]):
            return []
    score = named + max((_USE_SCORES.get(u, 0) for u in uses), default=0) + (DIRECT_BONUS if read.direct else 0)
    score -= _phase_penalty(path.text, context)
    trace = _traced(context, path, value)
    kind = KnobKind.FIELD if path.steps else KnobKind.VARIABLE
    return [
        Knob(
            path.text,
            value,
            kind,
            "value",
            score,
            trace.written,
            (Value(path),) + _via(trace, context),
            trace.origin,
            _evidence(read, uses),
        )
    ]


def _dataloader(path: ObjectPath, value: Any, read: _Read, context: _Context) -> list[Knob]:
    """A DataLoader the cell iterates or hands on: rebuilt with the new batch size."""
    if not is_dataloader(value) or not (read.uses & {Use.ITERATED, Use.ARGUMENT}):
        return []
    size = loader_batch_size(value)
    problem = loader_problem(value)
    label = f"{path.text}.batch_size"
    if size is None:
        return [Knob(label, 0, KnobKind.DATALOADER, "value", 0, (), (), "", (), problem or "it has no batch size")]
    iterated_here = read.direct and Use.ITERATED in read.uses
    score = AUTHORITATIVE + (DIRECT_BONUS if iterated_here else 0) - _phase_penalty(path.text, context)
    trace = _traced(context, path.attribute("batch_size"), size)
    how = (
        "iterated"
        if Use.ITERATED in read.uses
        else "passed to " + ("a call" if not read.readers else ", ".join(sorted(read.readers)) + "()")
    )
    return [
        Knob(
            label,
            size,
            KnobKind.DATALOADER,
            "value",
            score,
            trace.written,
            (Loader(path),) + _via(trace, context),
            trace.origin,
            (how,) + _evidence(read, set()),
            problem,
        )
    ]


def _hf_trainer(path: ObjectPath, value: Any, read: _Read, context: _Context) -> list[Knob]:
    """A Hugging Face Trainer the cell trains (``per_device_train_batch_size``) or evaluates (``..._eval_...``)."""
    if not is_hf_trainer(value):
        return []
    knobs = []
    wanted = []
    if read.methods & {"train"}:
        wanted.append(("per_device_train_batch_size", "train"))
    if read.methods & {"evaluate", "predict"}:
        wanted.append(("per_device_eval_batch_size", "eval"))
    for field_name, phase in wanted:
        size = getattr(value.args, field_name, None)
        if type(size) is not int:
            continue
        field_path = path.attribute("args").attribute(field_name)
        trace = _traced(context, field_path, size)
        penalty = (
            PHASE_PENALTY if context.scan.phase is not None and context.scan.phase != phase and len(wanted) > 1 else 0
        )
        knobs.append(
            Knob(
                field_path.text,
                size,
                KnobKind.TRAINER,
                "value",
                AUTHORITATIVE - penalty,
                trace.written,
                (TrainerArgs(path, field_name),) + _via(trace, context),
                trace.origin,
                (f"{path.text}.{'/'.join(sorted(read.methods & {'train', 'evaluate', 'predict'}))}() is called",),
            )
        )
    return knobs


def _training_arguments(path: ObjectPath, value: Any, read: _Read, context: _Context) -> list[Knob]:
    """``TrainingArguments`` the cell passes to a ``Trainer`` it builds."""
    if not is_training_arguments(value) or Use.ARGUMENT not in read.uses:
        return []
    field_name = "per_device_eval_batch_size" if context.scan.phase == "eval" else "per_device_train_batch_size"
    size = getattr(value, field_name, None)
    if type(size) is not int:
        return []
    field_path = path.attribute(field_name)
    trace = _traced(context, field_path, size)
    return [
        Knob(
            field_path.text,
            size,
            KnobKind.FIELD,
            "value",
            AUTHORITATIVE - 2,
            trace.written,
            (Value(field_path),) + _via(trace, context),
            trace.origin,
            ("passed to a Trainer",),
        )
    ]


def _lightning(path: ObjectPath, value: Any, read: _Read, context: _Context) -> list[Knob]:
    """A Lightning datamodule (or module building its own loaders) the cell fits or evaluates."""
    if not (read.uses & {Use.ARGUMENT}) or not is_lightning_holder(value):
        return []
    holders = lightning_batch_paths(value, path)
    if not holders:
        return []
    first, size = holders[0]
    trace = _traced(context, first, size)
    if not trace.written:
        for other, _ in holders[1:]:
            alternative = _traced(context, other, size)
            if alternative.written:
                trace = alternative
                break
    live = tuple(Value(p) for p, v in holders if v == size) + _via(trace, context)
    return [
        Knob(
            first.text,
            size,
            KnobKind.LIGHTNING,
            "value",
            AUTHORITATIVE,
            trace.written,
            live,
            trace.origin,
            ("passed to a Lightning Trainer" if read.opaque_argument else "passed to a call",),
        )
    ]


def _config(path: ObjectPath, value: Any, read: _Read, context: _Context) -> list[Knob]:
    """A config the cell hands to code we cannot read: its fields named like a batch size, weakly."""
    if not read.opaque_argument or not is_config_like(value) or isinstance(value, (list, tuple)):
        return []
    knobs = []
    for field_path, size in batch_fields(value, path):
        if size < 2:
            continue
        parent = resolve(context.scan.namespace, ObjectPath(field_path.root, field_path.steps[:-1]))
        if not settable(parent, field_path.steps[-1]):
            continue
        score = name_score(field_path.last_name) - 2 - _phase_penalty(field_path.text, context)
        trace = _traced(context, field_path, size)
        knobs.append(
            Knob(
                field_path.text,
                size,
                KnobKind.FIELD,
                "value",
                score,
                trace.written,
                (Value(field_path),) + _via(trace, context),
                trace.origin,
                (f"in {path.text}, passed to a call",),
            )
        )
    return knobs


def _loader_collection(path: ObjectPath, value: Any, read: _Read, context: _Context) -> list[Knob]:
    """A dict or list of DataLoaders whose items the cell takes by a computed key (``dataloaders[phase]``)."""
    if not (read.element_uses & {Use.ITERATED, Use.ARGUMENT}):
        return []
    items = (
        list(value.items())
        if isinstance(value, Mapping)
        else list(enumerate(value))
        if isinstance(value, (list, tuple))
        else []
    )
    knobs = []
    for key, item in items[:50]:
        if isinstance(key, (str, int)) and is_dataloader(item):
            item_read = _Read(uses=set(read.element_uses), direct=read.direct, readers=set(read.readers))
            knobs += _dataloader(path.child(Step(key, key=True)), item, item_read, context)
    return knobs


# One function per kind of knob; the first that recognises a value decides what it is.
_KNOB_READERS: tuple[Callable[[ObjectPath, Any, _Read, _Context], list[Knob]], ...] = (
    _hf_trainer,
    _training_arguments,
    _dataloader,
    _loader_collection,
    _lightning,
    _integer,
    _config,
)


def _function_defaults(context: _Context) -> list[Knob]:
    """Defaults of notebook functions the cell calls without that argument (``def train(..., bs=64)``)."""
    knobs = []
    for function_path, parameter, value, uses in context.scan.defaults:
        function = resolve(context.scan.namespace, function_path)
        score = name_score(parameter) + max((_USE_SCORES.get(u, 0) for u in uses), default=0)
        trace = context.scan.history.default_of(
            getattr(function, "__name__", function_path.last_name), parameter, value
        )
        knobs.append(
            Knob(
                f"{parameter} (default of {function_path.text}())",
                value,
                KnobKind.DEFAULT,
                "default",
                score - _phase_penalty(parameter, context),
                trace.written if trace else (),
                (Default(function_path, parameter),),
                trace.origin if trace else "",
                tuple(u.value for u in uses if u in _USE_SCORES),
            )
        )
    return knobs


def _earlier_tensors(context: _Context) -> list[Knob]:
    """Tensors from earlier cells the cell feeds whole to a module (``model(inputs)``), one knob per batch:
    their batch dimension, with the tensors the cell passes to other calls with as many rows (the labels).
    Only where the rows are written in a cell (a constructor's dimension, or the variable it was given)."""
    fed: dict[int, list[tuple[ObjectPath, int]]] = {}
    beside: dict[int, list[ObjectPath]] = {}
    for path, read in context.scan.reads.items():
        if not read.direct or read.uses <= {Use.PRINTED}:
            continue
        value = resolve(context.scan.namespace, path)
        shape = tensor_shape(value) if found(value) else None
        if not shape:
            continue
        rank = len(shape)
        dim = 1 if rank == 3 and path.root in context.scan.states else context.batch_dimension if rank >= 3 else 0
        rows = shape[dim]
        if rows < 2:
            continue
        if read.fed and rank >= 2:
            fed.setdefault(rows, []).append((path, dim))
        elif Use.ARGUMENT in read.uses and shape[0] >= 2:
            beside.setdefault(shape[0], []).append(path)  # labels, one-hot targets, masks: cut with the batch
    knobs = []
    for rows, tensors in fed.items():
        tensors.sort(key=lambda t: t[0].text)
        first, dim = tensors[0]
        trace = trace_rows(context.scan.history, first, dim, rows)
        if not trace.written:
            for other, other_dim in tensors[1:]:
                alternative = trace_rows(context.scan.history, other, other_dim, rows)
                if alternative.written:
                    trace = alternative
                    break
        if not trace.written:
            # Rows taken from elsewhere (``images, labels = next(iter(loader))``): the cell may index them by a
            # count of its own (``for i in range(4)``), so cutting them is not safe to guess.
            continue
        written = list(trace.written)
        for other, other_dim in tensors[1:] + [(p, 0) for p in sorted(beside.get(rows, []), key=lambda p: p.text)]:
            written += [w for w in trace_rows(context.scan.history, other, other_dim, rows).written if w not in written]
        live = tuple(Rows(p, d) for p, d in tensors) + tuple(Rows(p) for p in beside.get(rows, []))
        score = _USE_SCORES[Use.DIMENSION] + DIRECT_BONUS - _phase_penalty(first.text, context)
        knobs.append(
            Knob(
                f"{first.text}.shape[{dim}]",
                rows,
                KnobKind.TENSOR,
                "value",
                score,
                tuple(written),
                live + _via(trace, context),
                trace.origin,
                (f"fed whole to a module, {'dimension 1 (sequence-first)' if dim else 'its rows'}",),
            )
        )
    return knobs


def _cell_knobs(reader: _Reader, context: _Context, parsed: ParsedCell) -> list[Knob]:
    """Numbers written in the failed cell: assignments, keywords, defaults, dict values, slices... and
    literal tensor dimensions, grouped so every constructor of one batch moves together."""
    knobs: list[Knob] = []

    def written(nodes: Iterable[ast.AST], total: int | None = None) -> tuple[Written, ...]:
        spans = [parsed.span(n) for n in nodes]
        return tuple(Written(None, s, total=total) for s in spans if s is not None)

    def origin(nodes: list[ast.AST]) -> str:
        line = parsed.raw_line(nodes[0])
        return f"line {line}" if line else "the cell"

    for literal in reader.literals:
        if literal.form == "slice" and literal.sliced is not None:
            sliced = resolve(context.scan.namespace, literal.sliced)
            if is_module(sliced) or isinstance(sliced, str):
                continue  # ``model.layers[:6]``: a part of a model, not a batch
        penalty = _phase_penalty(literal.label, context)
        knobs.append(
            Knob(
                literal.label,
                literal.value,
                KnobKind.CELL,
                literal.form,
                literal.score - penalty,
                written(literal.nodes, literal.total),
                (),
                origin(literal.nodes),
                literal.evidence,
            )
        )
    for name, nodes in reader.assigned.items():
        uses = set(reader.local_uses.get(name, set()))
        if {context.batch_dimension, _STATE_BATCH} & reader.local_dims.get(name, set()):
            uses.add(Use.DIMENSION)
        batch_uses = {u for u in uses if u in _USE_SCORES}
        named = name_score(name)
        if not named and not batch_uses:
            continue
        if uses and uses <= {Use.PRINTED}:
            continue
        score = named + max((_USE_SCORES[u] for u in batch_uses), default=0) + CELL_BONUS + (1 if uses else 0)
        score -= _phase_penalty(name, context)
        for node in nodes:
            value = int_constant(node)
            if value is None or value < 2:
                continue
            knobs.append(
                Knob(
                    name,
                    value,
                    KnobKind.CELL,
                    "assignment",
                    score,
                    written([node]),
                    (),
                    origin([node]),
                    tuple(u.value for u in batch_uses),
                )
            )
    knobs.extend(_tensor_groups(reader, context, parsed))
    return knobs


def _tensor_groups(reader: _Reader, context: _Context, parsed: ParsedCell) -> list[Knob]:
    """Literal batch dimensions of tensor constructors, one knob per value. A square or repeated size is a
    matrix dimension, and so is a tensor used only in matrix products."""
    groups: dict[int, list[ast.AST]] = {}
    shaped: set[int] = set()  # values that lead a tensor of two or more dimensions (1-D ones are labels)
    # Sequence-first: the batch of (seq, batch, features) inputs and (layers, batch, hidden) states; a 2-D
    # tensor holding that batch in dimension 1, not 0, is (seq, batch) token ids.
    sequence_batches = {
        int_constant(c.shape[1]) for c in reader.constructors if context.batch_dimension == 1 and len(c.shape) >= 3
    } - {None}
    for constructor in reader.constructors:
        shape = constructor.shape
        index = context.batch_dimension if len(shape) >= 3 else 0
        if len(shape) == 3 and constructor.assigned_to in reader.scan.states:
            index = 1  # h0 / c0: (layers, batch, hidden) with or without batch_first
        if (
            len(shape) == 2
            and int_constant(shape[1]) in sequence_batches
            and int_constant(shape[0]) not in sequence_batches
        ):
            index = 1
        if index >= len(shape):
            continue
        lead = int_constant(shape[index])
        if lead is None or lead < 2:
            continue
        rest = [int_constant(n) for i, n in enumerate(shape) if i != index]
        if lead in rest:
            continue
        if constructor.assigned_to is not None:
            uses = reader.local_uses.get(constructor.assigned_to, set())
            if uses and uses <= {Use.MATMUL, Use.PRINTED}:
                continue
        groups.setdefault(lead, []).append(shape[index])
        if len(shape) >= 2:
            shaped.add(lead)
    knobs = []
    for value, nodes in groups.items():
        if value not in shaped:
            continue
        spans = [parsed.span(n) for n in nodes]
        written = tuple(Written(None, s) for s in spans if s is not None)
        if not written:
            continue
        label = "leading dimension" if context.batch_dimension == 0 else "batch dimension (sequence-first)"
        knobs.append(
            Knob(
                label,
                value,
                KnobKind.CELL,
                "tensor",
                _USE_SCORES[Use.DIMENSION] + min(len(written) - 1, 3),
                written,
                (),
                f"line {written[0].span.line}",
                ("same number in every tensor constructor",),
            )
        )
    return knobs


def _merge(knobs: list[Knob]) -> list[Knob]:
    """One knob per batch: a loader built from ``batch_size`` takes the variable's place in it; literal
    tensor dimensions equal to a named batch move with it; one batch written twice is one knob."""
    knobs = sorted(knobs, key=lambda k: -k.score)
    merged: list[Knob] = []
    for knob in knobs:
        target = None
        for index, kept in enumerate(merged):
            if _same_batch(kept, knob):
                target = index
                break
        if target is None:
            merged.append(knob)
        else:
            merged[target] = merged[target].merged(knob, bonus=0)
    return merged


def _same_batch(kept: Knob, other: Knob) -> bool:
    if kept.value != other.value or kept.problem or other.problem:
        return False
    if set(kept.written) & set(other.written):
        return True  # one number in the notebook: every loader or field built from it changes with it
    kept_values = {t.path for t in kept.live if isinstance(t, Value)}
    other_values = {t.path for t in other.live if isinstance(t, Value)}
    if other.live and all(isinstance(t, Value) for t in other.live) and other_values <= kept_values:
        return True  # the variable or field the loader (or Trainer) was built from
    if kept.live and other.kind is KnobKind.CELL and other.form == "tensor":
        return True  # torch.zeros(64, ...) beside batch_size = 64 read from the namespace
    if kept.kind is KnobKind.CELL and other.kind is KnobKind.CELL:
        if other.form == "tensor" and kept.form in ("assignment", "keyword", "dict", "default"):
            return True
        if {kept.form, other.form} <= {"slice", "range step", "split"}:
            return True  # ``range(0, n, 32)`` with ``texts[i:i + 32]``
        return kept.label == other.label and kept.form == other.form
    if kept.kind is other.kind is KnobKind.LIGHTNING:
        return True
    return kept.label == other.label and kept.kind is other.kind


def find_batch(
    source: str,
    namespace: Mapping[str, Any] | None = None,
    transform: Transform | None = None,
    *,
    history: list[str] | None = None,
    cell_number: int | None = None,
    parsed: ParsedCell | None = None,
) -> BatchFinding:
    """Every place the failed cell's batch size may live, most plausible first (see the module docstring).

    ``namespace`` is the user's; ``history`` IPython's raw input history (``In``: index ``k`` holds
    ``In[k]``) and ``cell_number`` the failed cell's ``k`` (cells from it on are ignored). ``transform``
    turns IPython input into Python (the shell's ``transform_cell``; IPython's own by default);
    ``parsed`` is ``source`` already parsed with it, so it is not parsed again. Never raises for bad
    input: ``problem`` says what is wrong.
    """
    try:
        if parsed is None or parsed.source != source:
            parsed = parse_cell(source, transform)
    except SyntaxError as error:
        return BatchFinding(
            source,
            (),
            f"the cell does not parse ({error.msg}, line {error.lineno}), so its batch size cannot be changed",
        )
    except Exception as error:  # IPython's transformer on odd input
        return BatchFinding(
            source, (), f"the cell could not be read as IPython input ({error}), so its batch size cannot be changed"
        )
    namespace = namespace if namespace is not None else {}
    scan = _Scan(namespace, History(history, cell_number, namespace, transform), transform)
    scan.states = recurrent_states(parsed.tree, namespace)
    reader = _Reader(scan, parsed, cell=True)
    reader.read_body(parsed.tree.body)
    sequence_first_input = (
        _feeds_sequence_first_model(scan)
        or builds_sequence_first(parsed.tree, namespace)
        or calls_sequence_first(parsed.tree, set(reader.bound_at), namespace)
    )
    context = _Context(scan, 1 if sequence_first_input else 0)
    knobs: list[Knob] = _cell_knobs(reader, context, parsed)
    for path, read in list(scan.reads.items()):
        value = resolve(namespace, path)
        if not found(value):
            continue
        for knob_reader in _KNOB_READERS:
            try:
                made = knob_reader(path, value, read, context)
            except Exception:  # noqa: BLE001  a user object whose attributes raise holds no batch we can change
                continue
            if made:
                knobs.extend(made)
                break
    knobs.extend(_function_defaults(context))
    knobs.extend(_earlier_tensors(context))
    notes = tuple(f"{k.label.rsplit('.batch_size', 1)[0]}: {k.problem}" for k in knobs if k.problem)
    ranked = sorted(
        _merge([k for k in knobs if k.score > 0 or k.problem]),
        key=lambda k: (-k.score if k.changeable else 1, k.line or parsed.body_line),
    )
    whole = covers_whole_data(BatchFinding(source, tuple(ranked)), namespace, transform, parsed)
    if not any(k.changeable for k in ranked):
        problem = (
            "no batch size in the cell: no integer named or used like a batch size, no tensor with a literal "
            "batch dimension, no DataLoader, Trainer, config or tensor with written rows it reads from an "
            "earlier cell"
        )
        return BatchFinding(source, tuple(ranked), problem, parsed.body_line, notes, whole, True)
    return BatchFinding(source, tuple(ranked), None, parsed.body_line, notes, whole, True)


def _feeds_sequence_first_model(scan: _Scan) -> bool:
    for path, read in scan.reads.items():
        if read.called or "forward" in read.methods:
            value = resolve(scan.namespace, path)
            if found(value) and is_module(value) and sequence_first(value):
                return True
    return False
