"""Change a cell's text in exactly the places meant, and show the change as a diff.

Every change ``%oomfix`` makes to code goes through here: a number replaced at its span (a batch
size in the failed cell or in an earlier ``In[k]``), a line inserted, the whole body wrapped in
``torch.autocast``. Nothing else in the text moves.
"""

from __future__ import annotations

import ast
import difflib
import functools
import io
import tokenize
from collections.abc import Iterable
from dataclasses import dataclass

from .source import Span, Transform, line_ending, parse_cell, split_lines


@dataclass(frozen=True)
class Edit:
    """Replace the text at ``span`` with ``text`` (an empty span inserts)."""

    span: Span
    text: str


def apply_edits(source: str, edits: Iterable[Edit]) -> str:
    """``source`` with every edit made; edits on one line are made right to left so columns stay valid."""
    lines = split_lines(source)
    for edit in sorted(set(edits), key=lambda e: (e.span.line, e.span.col, e.span.end_col), reverse=True):
        if not 0 < edit.span.line <= len(lines):
            raise ValueError(f"line {edit.span.line} is not in the cell ({len(lines)} lines)")
        text = lines[edit.span.line - 1]
        lines[edit.span.line - 1] = text[: edit.span.col] + edit.text + text[edit.span.end_col :]
    return "".join(lines)


def insert_line(source: str, line: int, text: str) -> str:
    """``source`` with ``text`` (no line ending) inserted as a new line before raw line ``line``."""
    lines = split_lines(source)
    newline = line_ending(source)
    index = max(line - 1, 0)
    if index > 0 and index <= len(lines) and not lines[index - 1].endswith(("\n", "\r")):
        lines[index - 1] += newline
    return "".join(lines[:index] + [text + newline] + lines[index:])


def unified_diff(
    before: str, after: str, name: str = "cell", before_label: str = "failed", after_label: str = "fits"
) -> str:
    """A unified diff of two versions of a cell, for display: lines compared without their ends, so a
    final newline one version lacks is no change (it showed an identical line removed and added)."""
    diff = difflib.unified_diff(
        before.splitlines(),
        after.splitlines(),
        fromfile=f"{name} ({before_label})",
        tofile=f"{name} ({after_label})",
        lineterm="",
    )
    return "".join(line + "\n" for line in diff)


@dataclass(frozen=True)
class CellDiff:
    """One cell as it is and as it should be: the failed cell itself or an earlier ``In[k]``."""

    label: str  # "the failed cell" or "In[3]"
    before: str
    after: str
    cell_number: int | None = None  # k of In[k]; None for the failed cell

    @functools.cached_property
    def changed(self) -> bool:
        return self.before.splitlines() != self.after.splitlines()

    @functools.cached_property
    def diff(self) -> str:
        """Made once: a report shows it in its text, its HTML and what ``--apply`` offers."""
        return unified_diff(self.before, self.after, self.label, "as run", "changed") if self.changed else ""


# -- autocast -------------------------------------------------------------------------------------
def _string_continuation_lines(python: str) -> set[int]:
    """1-based lines that continue a multi-line string token: indenting them would change the string."""
    inside: set[int] = set()
    try:
        for token in tokenize.generate_tokens(io.StringIO(python).readline):
            if token.type == tokenize.STRING or getattr(tokenize, "FSTRING_MIDDLE", -1) == token.type:
                inside.update(range(token.start[0] + 1, token.end[0] + 1))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        pass
    return inside


class AutocastNotApplicable(ValueError):
    """The cell's precision is not set by wrapping its code: a Trainer's argument sets it, or the step is
    in a function of an earlier cell. The message says where to set it."""


# Calls that must run outside autocast (PyTorch's guidance: autocast covers the forward pass and the
# loss; backward ops run in the dtype autocast chose for the matching forward ops, and the optimizer
# and the gradient scaler update float32 state).
_OUTSIDE_ATTRIBUTES = frozenset({"backward", "step", "zero_grad", "update", "unscale_", "clip_grad_norm_",
                                 "clip_grad_value_"})
_OUTSIDE_FUNCTIONS = frozenset({"clip_grad_norm_", "clip_grad_value_"})
# Calls that compute nothing on the GPU: a run of statements made only of these is not wrapped.
_NOT_COMPUTE = frozenset({"print", "len", "range", "enumerate", "zip", "isinstance", "str", "int", "float", "repr",
                          "format", "item", "append", "extend", "log", "info", "debug", "set_postfix", "write",
                          "train", "eval", "tolist", "sleep", "time", "perf_counter"})
_TRAINER_METHODS = frozenset({"fit", "train"})

_BODIES = ("body", "orelse", "finalbody")


def _called(call: ast.Call) -> tuple[str, ast.AST | None]:
    """``(name, receiver)``: ``("step", <optimizer>)`` for ``optimizer.step()``, ``("f", None)`` for ``f()``."""
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr, func.value
    if isinstance(func, ast.Name):
        return func.id, None
    return "", None


def _trainer_call(call: ast.Call, trainers: set[str]) -> bool:
    """``trainer.train()``, ``trainer.fit(model, dm)``: a Trainer (a name bound to ``*Trainer(...)`` in
    the cell, or a name that says it is one) trains, not ``model.train()`` that sets a mode."""
    name, receiver = _called(call)
    if name not in _TRAINER_METHODS or not isinstance(receiver, ast.Name):
        return False
    return receiver.id in trainers or receiver.id.lower().endswith("trainer")


class _Wrapper:
    """Finds, block by block, the runs of statements that compute (forward, loss) between the ones that
    must stay outside autocast (backward, optimizer and scheduler steps, ``zero_grad``)."""

    def __init__(self, tree: ast.Module, outside_names: frozenset[str]):
        self.trainers = {
            target.id
            for node in ast.walk(tree) if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
            and _called(node.value)[0].endswith("Trainer")
            for target in node.targets if isinstance(target, ast.Name)
        }
        self.outside_names = set(outside_names)
        # Functions of this cell that step (directly or through another of them): a call of one stays
        # outside, and its own body is wrapped inside.
        functions = {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        changed = True
        while changed:
            changed = False
            for name, function in functions.items():
                if name not in self.outside_names and self._steps(function, nested=True):
                    self.outside_names.add(name)
                    changed = True
        self.runs: list[tuple[int, int]] = []  # (first, last) statements' transformed lines, inclusive
        self.trainer_calls: list[ast.Call] = []

    def _steps(self, node: ast.AST, nested: bool = False) -> bool:
        """Whether ``node`` calls something that must run outside autocast (inside functions it defines
        only when ``nested``: defining a function runs none of it)."""
        for child in _walk(node, nested):
            if isinstance(child, ast.Call):
                name, receiver = _called(child)
                if (receiver is not None and name in _OUTSIDE_ATTRIBUTES) or name in _OUTSIDE_FUNCTIONS:
                    return True
                if receiver is None and name in self.outside_names:
                    return True
                if _trainer_call(child, self.trainers):
                    self.trainer_calls.append(child)
                    return True
        return False

    def block(self, statements: list[ast.stmt]) -> None:
        run: list[ast.stmt] = []
        shared_lines = self._lines_of_stepping(statements)
        for statement in statements:
            if isinstance(statement, _NOT_WRAPPED):
                self._close(run)
                self._definition(statement)
                continue
            lines = set(range(statement.lineno, (statement.end_lineno or statement.lineno) + 1))
            if not self._steps(statement) and not (lines & shared_lines):
                run.append(statement)
                continue
            self._close(run)
            for body in self._bodies(statement):
                if body[0].lineno > statement.lineno:  # not ``for x in y: step()`` on one line
                    self.block(body)
        self._close(run)

    def _definition(self, statement: ast.stmt) -> None:
        """A definition ends a run; a function named in ``outside_names`` and a class's methods that step
        are entered (the step is inside: wrap its forward there). Imports and declarations end a run too."""
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if statement.name in self.outside_names:
                self.block(statement.body)
        elif isinstance(statement, ast.ClassDef):
            for member in statement.body:
                if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)) and self._steps(member, True):
                    self.block(member.body)

    def _lines_of_stepping(self, statements: list[ast.stmt]) -> set[int]:
        """Lines of simple statements that step: another statement on the same line (``out = model(x);
        loss.backward()``) cannot be wrapped apart from it."""
        lines: set[int] = set()
        for statement in statements:
            if not self._bodies(statement) and self._steps(statement):
                lines |= set(range(statement.lineno, (statement.end_lineno or statement.lineno) + 1))
        return lines

    @staticmethod
    def _bodies(statement: ast.stmt) -> list[list[ast.stmt]]:
        """The blocks of a compound statement; an ``elif`` (an ``If`` alone in ``orelse``, at the column of
        its ``if``) is not a block of its own: its blocks are."""
        if isinstance(statement, ast.If):
            bodies = [statement.body]
            orelse = statement.orelse
            if len(orelse) == 1 and isinstance(orelse[0], ast.If) and orelse[0].col_offset == statement.col_offset:
                return bodies + _Wrapper._bodies(orelse[0])
            return bodies + ([orelse] if orelse else [])
        bodies = [getattr(statement, name) for name in _BODIES if getattr(statement, name, None)]
        if isinstance(statement, (ast.Try, ast.TryStar)):
            bodies += [handler.body for handler in statement.handlers]
        if isinstance(statement, ast.Match):
            bodies += [case.body for case in statement.cases]
        return bodies

    def _close(self, run: list[ast.stmt]) -> None:
        if run and any(_computes(statement) for statement in run):
            self.runs.append((run[0].lineno, run[-1].end_lineno or run[-1].lineno))
        run.clear()


# Statements a ``with`` block never wraps: definitions, imports and scope declarations.
_NOT_WRAPPED = (
    ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom, ast.Global, ast.Nonlocal
)


def _walk(node: ast.AST, nested: bool) -> list[ast.AST]:
    """``ast.walk`` that does not enter function or class definitions below ``node`` unless ``nested``."""
    found: list[ast.AST] = []
    pending = [node]
    while pending:
        current = pending.pop()
        found.append(current)
        for child in ast.iter_child_nodes(current):
            if not nested and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                continue
            pending.append(child)
    return found


def _computes(statement: ast.stmt) -> bool:
    """Whether a statement calls anything but printing, logging and bookkeeping (``loss.item()``), or
    multiplies matrices (``a @ b``: what autocast runs in half precision)."""
    return any(
        (isinstance(node, ast.Call) and _called(node)[0] not in _NOT_COMPUTE)
        or (isinstance(node, (ast.BinOp, ast.AugAssign)) and isinstance(node.op, ast.MatMult))
        for node in _walk(statement, False)
    )


def _trainer_trains(dtype: str) -> AutocastNotApplicable:
    precision = "bf16=True" if dtype == "bfloat16" else "fp16=True"
    lightning = "bf16-mixed" if dtype == "bfloat16" else "16-mixed"
    return AutocastNotApplicable(
        "a Trainer trains in this cell: its mixed precision is its argument, not a with block "
        f"(Hugging Face: TrainingArguments(..., {precision}); Lightning: Trainer(..., precision=\"{lightning}\"))"
    )


def _wrapped_lines(
    body: list[str], runs: list[tuple[int, int]], inside_string: set[int], opening: str, newline: str
) -> list[str]:
    """``body`` with ``opening`` before each run of lines (raw, 1-based, both ends included) at the run's
    first line's indent, and the run's lines indented by four spaces, blank lines and lines inside a
    multi-line string excepted."""
    openings: dict[int, str] = {}  # raw body line (1-based) -> the ``with`` line to put before it
    indented: set[int] = set()
    for start, end in runs:
        text = body[start - 1]
        indent = text[: len(text) - len(text.lstrip())]
        openings[start] = indent + opening + newline
        indented |= set(range(start, end + 1))
    wrapped = []
    for number, line in enumerate(body, start=1):
        if number in openings:
            wrapped.append(openings[number])
        if number in indented and line.strip() and number not in inside_string:
            line = "    " + line
        wrapped.append(line)
    return wrapped


def wrap_in_autocast(
    source: str,
    dtype: str = "bfloat16",
    import_torch: bool = True,
    transform: Transform | None = None,
    outside_names: frozenset[str] = frozenset(),
) -> str:
    """``source`` with its forward passes and losses inside ``with torch.autocast("cuda", dtype=torch.<dtype>):``.

    PyTorch's autocast guidance: autocast covers the forward pass and the loss; ``backward()``, the
    optimizer's and scheduler's ``step()``, ``zero_grad()`` and a GradScaler's ``update()`` run outside.
    So each block (the cell, a loop's body, a ``def train_step`` the cell defines and calls) is split
    at the statements that make those calls (or call a function of the cell, or one named in
    ``outside_names``, that does), and each run of statements between them that computes is wrapped.
    A cell that only computes (inference) is wrapped whole.

    A cell-magic header stays first. Lines are indented by four spaces except lines inside a
    multi-line string (found by tokenizing what IPython would run, so ``!cmd`` lines do not confuse
    it); IPython accepts indented ``!cmd`` and ``%magic`` lines. Raises ``SyntaxError`` when the
    cell does not parse, so a broken cell is never wrapped, and ``AutocastNotApplicable`` when a
    Trainer trains (its mixed precision is one of its arguments) or nothing in the cell computes
    outside a stepping function of another cell.
    """
    if dtype not in {"bfloat16", "float16"}:
        raise ValueError(f"autocast dtype must be bfloat16 or float16, got {dtype!r}")
    parsed = parse_cell(source, transform)  # read only: the wrapper finds lines and edits the text
    wrapper = _Wrapper(parsed.tree, outside_names)
    wrapper.block(parsed.tree.body)
    if wrapper.trainer_calls:
        raise _trainer_trains(dtype)
    raw_lines = split_lines(source)
    header, body = raw_lines[: parsed.header_lines], raw_lines[parsed.header_lines :]
    newline = line_ending(source)
    if not any(line.strip() for line in body):
        body = ["pass" + newline]
        wrapper.runs = [(1, 1)]
    if not wrapper.runs:
        raise AutocastNotApplicable(
            "nothing in the cell computes outside a function that also steps: wrap the forward pass and the "
            "loss in torch.autocast inside that function, and keep backward() and step() outside"
        )
    transformed = "".join(parsed.transformed_lines)

    def raw(line: int) -> int:  # a transformed line's raw line (IPython's transforms keep one line per line)
        return parsed.line_map.get(line, parsed.header_lines + line) - parsed.header_lines

    inside_string = {raw(t) for t in _string_continuation_lines(transformed)}
    runs = [(raw(first), raw(last)) for first, last in wrapper.runs]
    wrapped = _wrapped_lines(body, runs, inside_string, f'with torch.autocast("cuda", dtype=torch.{dtype}):', newline)
    if wrapped and not wrapped[-1].endswith(("\n", "\r")):
        wrapped[-1] += newline
    opening = ["import torch" + newline] if import_torch else []
    if header and not header[-1].endswith(("\n", "\r")):
        header[-1] += newline
    return "".join(header + opening + wrapped)
