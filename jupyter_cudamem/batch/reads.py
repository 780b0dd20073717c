"""What reading code records about the user's namespace, and the scores its evidence gives.

Shared by every reader of one finding (``reader``, ``expressions``, ``calls``) and by the functions that
turn reads into knobs (``namespace_knobs``, ``cell_numbers``): the vocabulary of uses, the scores, and
the ``Scan`` that one finding fills.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

from ..cell.source import Transform
from .knobs import ObjectPath
from .names import phase_of
from .provenance import History


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


USE_SCORES = {
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
CARRIED_THROUGH_ARITHMETIC = {Use.DIMENSION, Use.BATCH_ARGUMENT, Use.STEP, Use.SLICE, Use.SPLIT, Use.GENERATION}
AUTHORITATIVE = 20
CELL_BONUS = 2
DIRECT_BONUS = 1
PHASE_PENALTY = 6
UNCLEAR_EVAL_PENALTY = 5
MAX_FUNCTION_DEPTH = 3
# Dimensions of a recurrent state ``(layers, batch, hidden)``, recorded as such: its batch whatever the
# input's batch dimension is, and its layers, never a batch.
STATE_BATCH = -1
STATE_LAYERS = -2


@dataclass
class Read:
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


class Scan:
    """Everything read in one finding: shared by the cell's reader and those of the functions it calls."""

    def __init__(self, namespace: Mapping[str, object], history: History, transform: Transform | None):
        self.namespace = namespace
        self.history = history
        self.transform = transform
        self.reads: dict[ObjectPath, Read] = {}
        self.defaults: list[tuple[ObjectPath, str, int, set[Use]]] = []  # (function, parameter, value, uses)
        self.analysed: set[tuple[int, tuple[tuple[str, ObjectPath | None], ...]]] = set()
        self.trains = False
        self.states: set[str] = set()  # names the cell passes as an RNN's hidden state (``recurrent_states``)
        # Names whose dimensions (from the end) a matrix product of the cell sums over (``contracted_dims``).
        self.contracted: dict[str, set[int]] = {}
        self.evaluates = False

    def read(self, path: ObjectPath) -> Read:
        return self.reads.setdefault(path, Read())

    @property
    def phase(self) -> str | None:
        if self.trains:
            return "train"
        return "eval" if self.evaluates else None


@dataclass
class Context:
    """What turning reads into knobs needs to know of the finding."""

    scan: Scan
    batch_dimension: int  # 0, or 1 for a cell feeding a sequence-first model


def phase_penalty(text: str, context: Context) -> int:
    """A knob named for the other phase than the cell's (``eval_batch_size`` in a training cell) scores less."""
    knob_phase = phase_of(text)
    cell_phase = context.scan.phase
    if knob_phase is None:
        return 0
    if cell_phase is None:
        return UNCLEAR_EVAL_PENALTY if knob_phase == "eval" else 0
    return PHASE_PENALTY if knob_phase != cell_phase else 0

