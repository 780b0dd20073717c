"""Numbers written in the failed cell that may be its batch, and the knobs they make.

The cell's own numbers are rewritten in its text, not set in the namespace, so they are collected
apart from the namespace's reads while the cell is read (``reader``): a ``batch_size = 64``, a keyword,
a slice width, a tensor constructor's dimension, and how the cell uses each name it binds itself.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Iterable
from dataclasses import dataclass

from ..cell.source import ParsedCell, int_constant
from .knobs import Form, Knob, KnobKind, ObjectPath, Written
from .libraries import is_module, resolve
from .names import name_score
from .reads import CELL_BONUS, STATE_BATCH, USE_SCORES, Context, Use, phase_penalty


@dataclass
class CellNumber:
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
class Constructor:
    """A tensor constructor with a literal shape in the cell."""

    call: ast.Call
    shape: list[ast.AST]
    assigned_to: str | None
    matrix: frozenset[int] = frozenset()  # dimensions that are a matrix's side or inner size (``matrix_dims``)


class CellNumbers:
    """What the failed cell writes itself: candidate numbers, literal tensor shapes, ints it assigns to a
    name, and how it uses the names it binds. Empty for a notebook function's body (only the cell is rewritten)."""

    def __init__(self, parsed: ParsedCell | None):
        self.parsed = parsed
        self.literals: list[CellNumber] = []
        self.constructors: list[Constructor] = []
        self.assigned: dict[str, list[ast.expr]] = {}
        self.local_uses: dict[str, set[Use]] = {}
        self.local_dims: dict[str, set[int]] = {}

    def text(self, node: ast.AST) -> str | None:
        if self.parsed is None:
            return None
        span = self.parsed.span(node)
        text = self.parsed.text(span) if span is not None else None
        return text if text is None or len(text) <= 60 else text[:59] + "…"

    def add(
        self,
        form: Form,
        label: str,
        node: ast.AST,
        score: int,
        evidence: tuple[str, ...] = (),
        sliced: ObjectPath | None = None,
        total: int | None = None,
    ) -> None:
        """Keep ``node`` as a candidate if it is an int of at least 2 written in the cell's text; for a count of
        chunks of ``total`` items, the batch it makes."""
        value = int_constant(node)
        if value is None or value < 2 or self.parsed is None or self.parsed.span(node) is None:
            return
        batch = math.ceil(total / value) if total else value
        self.literals.append(CellNumber(form, label, batch, [node], score, evidence, sliced, total))

    def add_use(
        self,
        form: Form,
        use: Use,
        number: ast.AST,
        label: str,
        *,
        code: ast.AST | None = None,
        extra_score: int = 0,
        sliced: ObjectPath | None = None,
        total: int | None = None,
    ) -> None:
        """``add`` for an int the cell writes where it is used as ``use`` (a range step, a slice width, a
        split size, a count of chunks or of items stacked, a list replication, a batch keyword): scored
        by that use (plus ``extra_score``), its evidence the use. Labelled with ``code`` as typed, or
        ``label`` where there is no such text (its ``{}`` is the number)."""
        value = int_constant(number)
        if value is None or value < 2:
            return
        text = self.text(code) if code is not None else None
        score = USE_SCORES[use] + CELL_BONUS + extra_score
        self.add(form, text or label.format(value), number, score, (use.value,), sliced, total)


def cell_knobs(numbers: CellNumbers, context: Context, parsed: ParsedCell) -> list[Knob]:
    """Numbers written in the failed cell: assignments, keywords, defaults, dict values, slices... and
    literal tensor dimensions, grouped so every constructor of one batch moves together."""
    knobs: list[Knob] = []

    def written(nodes: Iterable[ast.AST], total: int | None = None) -> tuple[Written, ...]:
        spans = [parsed.span(n) for n in nodes]
        return tuple(Written(None, s, total=total) for s in spans if s is not None)

    def origin(nodes: list[ast.AST]) -> str:
        line = parsed.raw_line(nodes[0])
        return f"line {line}" if line else "the cell"

    for literal in numbers.literals:
        if literal.form == "slice" and literal.sliced is not None:
            sliced = resolve(context.scan.namespace, literal.sliced)
            if is_module(sliced) or isinstance(sliced, str):
                continue  # ``model.layers[:6]``: a part of a model, not a batch
        penalty = phase_penalty(literal.label, context)
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
    for name, nodes in numbers.assigned.items():
        scored = _assignment_score(name, numbers, context)
        if scored is None:
            continue
        score, batch_uses = scored
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
    knobs.extend(tensor_groups(numbers, context, parsed))
    return knobs


def _assignment_score(name: str, numbers: CellNumbers, context: Context) -> tuple[int, set[Use]] | None:
    """A name the cell assigns a number to, as a batch: its score and its uses that say batch; ``None``
    when neither its name nor its uses say batch, or it is only printed."""
    uses = set(numbers.local_uses.get(name, set()))
    if {context.batch_dimension, STATE_BATCH} & numbers.local_dims.get(name, set()):
        uses.add(Use.DIMENSION)
    batch_uses = {u for u in uses if u in USE_SCORES}
    named = name_score(name)
    if not named and not batch_uses:
        return None
    if uses and uses <= {Use.PRINTED}:
        return None
    score = named + max((USE_SCORES[u] for u in batch_uses), default=0) + CELL_BONUS + (1 if uses else 0)
    return score - phase_penalty(name, context), batch_uses


def _batch_index(constructor: Constructor, context: Context, sequence_batches: set[int | None]) -> int:
    """Which of a constructor's dimensions is the batch: the context's for three or more dimensions (the
    second for an RNN's states), else the first, or the second of (seq, batch) token ids."""
    shape = constructor.shape
    index = context.batch_dimension if len(shape) >= 3 else 0
    if len(shape) == 3 and constructor.assigned_to in context.scan.states:
        index = 1  # h0 / c0: (layers, batch, hidden) with or without batch_first
    if (
        len(shape) == 2
        and int_constant(shape[1]) in sequence_batches
        and int_constant(shape[0]) not in sequence_batches
    ):
        index = 1
    return index


def _only_in_products(constructor: Constructor, numbers: CellNumbers) -> bool:
    """Whether the tensor is used only in matrix products (and printed): a matrix, not a batch."""
    if constructor.assigned_to is None:
        return False
    uses = numbers.local_uses.get(constructor.assigned_to, set())
    return bool(uses) and uses <= {Use.MATMUL, Use.PRINTED}


def tensor_groups(numbers: CellNumbers, context: Context, parsed: ParsedCell) -> list[Knob]:
    """Literal batch dimensions of tensor constructors, one knob per value. A square or repeated size is a
    matrix dimension, and so is a tensor used only in matrix products, and a dimension a matrix product
    sums over (``sketch = torch.randn(4096, 256)`` in ``A @ sketch``)."""
    groups: dict[int, list[ast.AST]] = {}
    shaped: set[int] = set()  # values that lead a tensor of two or more dimensions (1-D ones are labels)
    # Sequence-first: the batch of (seq, batch, features) inputs and (layers, batch, hidden) states; a 2-D
    # tensor holding that batch in dimension 1, not 0, is (seq, batch) token ids.
    sequence_batches = {
        int_constant(c.shape[1]) for c in numbers.constructors if context.batch_dimension == 1 and len(c.shape) >= 3
    } - {None}
    for constructor in numbers.constructors:
        shape = constructor.shape
        index = _batch_index(constructor, context, sequence_batches)
        if index >= len(shape) or index in constructor.matrix:
            continue
        lead = int_constant(shape[index])
        if lead is None or lead < 2:
            continue
        rest = [int_constant(n) for i, n in enumerate(shape) if i != index]
        if lead in rest:
            continue
        if _only_in_products(constructor, numbers):
            continue
        groups.setdefault(lead, []).append(shape[index])
        if len(shape) >= 2:
            shaped.add(lead)
    # The side of a square matrix written in the cell is a matrix size wherever else it is written.
    sides = {int_constant(c.shape[0]) for c in numbers.constructors if len(c.shape) == 2 and c.matrix == {0, 1}}
    knobs = []
    for value, nodes in groups.items():
        if value not in shaped or value in sides:
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
                USE_SCORES[Use.DIMENSION] + min(len(written) - 1, 3),
                written,
                (),
                f"line {written[0].span.line}",
                ("same number in every tensor constructor",),
            )
        )
    return knobs
