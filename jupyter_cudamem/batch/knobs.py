"""What the finder hands on: a knob (one batch size, every place it must change) and its provenance.

A knob is data: what it is (``label``), its value now, where it lives while the kernel runs
(``live``: a variable, a key or attribute of a config, a DataLoader, a Trainer's arguments, a
function's default, an argument a ``functools.partial`` binds, the rows of a tensor) and where it is written (``written``: numbers in the failed cell or in an
earlier ``In[k]``). Changing it is ``batch.change``'s business; this module only describes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Literal

from ..cell.source import Span


class KnobKind(Enum):
    """Where the batch size lives while the kernel runs."""

    CELL = "written in the cell"
    VARIABLE = "a variable"
    FIELD = "a config field"
    DATALOADER = "a DataLoader"
    TRAINER = "Trainer arguments"
    LIGHTNING = "a Lightning datamodule"
    DEFAULT = "a function's default"
    TENSOR = "a tensor from an earlier cell"
    BOUND = "an argument a functools.partial binds"


# How the number is written where it is written.
Form = Literal[
    "assignment",
    "keyword",
    "default",
    "dict",
    "tensor",
    "slice",
    "range step",
    "split",
    "chunks",
    "replication",
    "count",
    "value",
]


@dataclass(frozen=True)
class Step:
    """One step from an object to a value inside it: ``["batch_size"]`` (a key) or ``.batch_size``."""

    name: str | int
    key: bool = False

    def text(self) -> str:
        if self.key:
            return f"[{self.name!r}]".replace("'", '"') if isinstance(self.name, str) else f"[{self.name}]"
        return f".{self.name}"


@dataclass(frozen=True)
class ObjectPath:
    """A value reached from a name in the user's namespace: ``config["batch_size"]``, ``trainer.args``."""

    root: str
    steps: tuple[Step, ...] = ()

    @property
    def text(self) -> str:
        return self.root + "".join(step.text() for step in self.steps)

    def child(self, step: Step) -> ObjectPath:
        return ObjectPath(self.root, self.steps + (step,))

    def attribute(self, name: str) -> ObjectPath:
        return self.child(Step(name))

    @property
    def last_name(self) -> str:
        return str(self.steps[-1].name) if self.steps else self.root

    def __str__(self) -> str:
        return self.text


# -- where the value lives while the kernel runs --------------------------------------------------
@dataclass(frozen=True)
class Value:
    """An int at a path: a variable (no steps), a dict key, an attribute of a config or object."""

    path: ObjectPath


@dataclass(frozen=True)
class Loader:
    """A DataLoader at a path, rebuilt with the new batch size and everything else kept."""

    path: ObjectPath


@dataclass(frozen=True)
class TrainerArgs:
    """A Hugging Face ``Trainer`` at ``path``: its ``args.<field>`` and the batch it copied from them."""

    path: ObjectPath
    field: str  # per_device_train_batch_size or per_device_eval_batch_size


@dataclass(frozen=True)
class Default:
    """A default of a function's parameter (the function at ``path``)."""

    path: ObjectPath
    parameter: str


@dataclass(frozen=True)
class Rows:
    """A tensor at a path whose dimension ``dim`` is the batch (``inputs = torch.randn(64, ...)`` made in an
    earlier cell): cut to the batch for a try (a view: no copy), or repeated when a try needs more rows."""

    path: ObjectPath
    dim: int = 0


@dataclass(frozen=True)
class Bound:
    """An argument a ``functools.partial`` at ``path`` binds (``partial(DataLoader, batch_size=128)``): a new
    partial with that argument changed, and everything else kept, is bound where the old one was."""

    path: ObjectPath
    parameter: str


LiveTarget = Value | Loader | TrainerArgs | Default | Rows | Bound


# -- where it is written ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Written:
    """A number in a cell's text that sets the batch: rewriting it changes the batch when the cell runs.

    ``cell`` is ``None`` for the failed cell itself, else the ``k`` of ``In[k]``. ``insert`` is set when
    nothing is written yet and a keyword must be added (``", per_device_train_batch_size={}"``).
    ``total`` is set for a count of chunks: a batch of ``b`` is then ``ceil(total / b)`` chunks.
    """

    cell: int | None
    span: Span
    insert: str | None = None
    total: int | None = None

    def text_for(self, batch: int) -> str:
        number = math.ceil(self.total / batch) if self.total else batch
        return self.insert.format(number) if self.insert is not None else str(number)

    def where(self) -> str:
        return f"line {self.span.line}" if self.cell is None else f"In[{self.cell}] line {self.span.line}"


@dataclass(frozen=True)
class Trace:
    """Where a value was set: the numbers to rewrite (maybe none), in words, and what it passed through."""

    written: tuple[Written, ...]
    origin: str
    via: tuple[ObjectPath, ...] = ()  # namespace paths on the way that hold the same value
    # Every cell whose statement the value passed through on its way from where it is written to where it
    # lives (``loader = DataLoader(ds, batch_size=batch_size)``, ``accelerator.prepare(loader)``).
    through: tuple[int, ...] = ()


@dataclass(frozen=True)
class Knob:
    """One batch size and every place that must change together to change it."""

    label: str  # what the user reads: ``batch_size``, ``config["batch_size"]``, ``train_loader.batch_size``
    value: int
    kind: KnobKind
    form: Form
    score: int
    written: tuple[Written, ...] = ()
    live: tuple[LiveTarget, ...] = ()
    origin: str = ""  # where it was set, in words: "line 3", "In[2] line 1", "TrainingArguments' default"
    evidence: tuple[str, ...] = ()
    problem: str | None = None  # why it cannot be changed (a custom batch_sampler...)
    notes: tuple[str, ...] = field(default=(), compare=False)
    through: tuple[int, ...] = ()  # ``Trace.through`` of where it was traced

    @property
    def reruns(self) -> tuple[int, ...]:
        """Earlier cells, unchanged, that must run again after the changed ones for the batch to reach where
        it lives: the cell that built a loader from the variable, the cell that prepared that loader."""
        changed = [w.cell for w in self.written if w.cell is not None]
        first = min(changed, default=0)
        return tuple(sorted(c for c in set(self.through) if c > first and c not in changed))

    @property
    def changeable(self) -> bool:
        return self.problem is None and self.value >= 1 and bool(self.written or self.live)

    @property
    def in_cell(self) -> bool:
        """Whether rewriting the failed cell alone changes it (nothing lives outside the cell)."""
        return not self.live and all(w.cell is None for w in self.written)

    @property
    def line(self) -> int:
        """The failed cell's line that sets it (0 when it is set elsewhere)."""
        return next((w.span.line for w in self.written if w.cell is None), 0)

    def describe(self) -> str:
        if self.form == "keyword":
            text = f"{self.label}={self.value}"
        elif self.form == "tensor":
            text = f"{self.label} {self.value}"
        elif self.form == "default":
            text = f"default {self.label}={self.value}"
        elif self.form == "dict" and self.kind is KnobKind.CELL:
            text = f"'{self.label}': {self.value}"
        elif self.form in ("slice", "range step", "split", "chunks", "replication", "count"):
            text = f"{self.label} (batch {self.value})"
        else:
            text = f"{self.label} = {self.value}"
        where = self.origin or "set in an earlier cell"
        if self.kind is not KnobKind.CELL:
            where = f"{self.kind.value}, {where}"
        text = f"{text} ({where})"
        if self.problem:
            text += f": {self.problem}"
        return text

    def merged(self, other: Knob, bonus: int = 1) -> Knob:
        """This knob, also changing what ``other`` changes (the same batch, reached another way)."""
        return replace(
            self,
            written=self.written + tuple(w for w in other.written if w not in self.written),
            live=self.live + tuple(t for t in other.live if t not in self.live),
            score=max(self.score, other.score) + bonus,
            evidence=self.evidence + tuple(e for e in other.evidence if e not in self.evidence),
            through=self.through + tuple(c for c in other.through if c not in self.through),
        )


@dataclass(frozen=True)
class ModelCall:
    """A model call over the data that chunks can replace: where it sits and its two parts as written."""

    span: Span
    callee: str  # ``classifier`` as written
    data: str  # ``features`` as written (the one positional argument)


@dataclass(frozen=True)
class WholeData:
    """The batch is the data: shrinking it shrinks the result. ``reason`` says how that was decided."""

    knob: str | None  # the knob's label, or None when the data came whole from an earlier cell
    rows: int | None  # how many rows the data has, where known
    results: tuple[str, ...]  # the names (or ``Out``) that keep a result computed from the data
    reason: str
    calls: tuple[ModelCall, ...] = ()
    problem: str | None = None  # why the data cannot be processed in chunks instead

    @property
    def chunkable(self) -> bool:
        return self.problem is None and bool(self.calls)


@dataclass(frozen=True)
class BatchFinding:
    """What the finder made of a failed cell: knobs best first, or why there are none."""

    source: str
    knobs: tuple[Knob, ...]
    problem: str | None = None  # a one-line reason when nothing can be shrunk
    body_line: int = 1  # the first line after any cell-magic header
    notes: tuple[str, ...] = ()  # what was seen but cannot be changed (a custom batch_sampler...)
    # Set when the batch is the data itself (inference or a metric over a whole tensor): a smaller
    # batch would compute a smaller result. ``whole_data.reason`` says how that was decided (``whole``).
    whole_data: WholeData | None = None
    # Whether ``whole_data`` was decided for ``chosen`` (``find_batch`` decides it): then ``None`` means a
    # smaller batch is a fix, and nothing decides it again.
    whole_data_decided: bool = False

    @property
    def covers_whole_data(self) -> bool:
        return self.whole_data is not None

    @property
    def chosen(self) -> Knob | None:
        return next((k for k in self.knobs if k.changeable), None)

    @property
    def others(self) -> tuple[Knob, ...]:
        chosen = self.chosen
        return tuple(k for k in self.knobs if k is not chosen)

    def summary(self) -> str:
        chosen = self.chosen
        if chosen is None:
            text = self.problem or "no batch size in the cell"
            if self.notes:
                text += "; " + "; ".join(self.notes)
            return text
        text = f"batch size: {chosen.describe()}"
        if self.others:
            text += "; also seen: " + ", ".join(k.describe() for k in self.others[:4])
        return text
