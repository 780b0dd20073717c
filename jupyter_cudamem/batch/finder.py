"""Where a failed cell's batch size lives: in its own text, or in what it reads from earlier cells.

The cell is read once (``reader.BodyReader``): every name and object path it reads from the
namespace, and how (as a tensor's batch dimension, as a ``batch_size=`` argument, iterated, passed to
a call, only printed...); the same for the notebook functions it calls, through their source in the
input history, with their parameters bound to what the cell passed. Numbers written in the cell are
read with the same eyes (``cell_numbers``). Then each kind of knob is one function over those reads
(``namespace_knobs.KNOB_READERS``): an int named or used as a batch, a DataLoader the cell iterates
or passes on, a Hugging Face ``Trainer`` it trains or evaluates, ``TrainingArguments`` it passes, a
Lightning datamodule or module it fits, a config it hands to code we cannot read. Each knob is traced
to where it was written (``provenance``), and knobs that are one batch reached two ways (a loader
built from ``batch_size``) are merged, so changing one changes all.

Scores rank the knobs; they add up evidence, never tuned to a case:

- what a name says (``names.name_score``: 10 for ``batch_size``, 8 for ``eval_bs``, 0 for ``n``);
- how the value is used (``reads.USE_SCORES``: passed as a batch size 6, a tensor's batch dimension 5, a
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
list of zeros (a per-class accumulator), a square or matmul-only matrix, a dimension a matrix product
sums over (``tensors.contracted_dims``), a chunk count whose total is unknown.

This module is the entry point (``find_batch``) and the merging of knobs that are one batch. The reading
is split by job: ``reader`` (statements, and following calls into notebook code), ``expressions``,
``calls``, ``scope`` (whose names are whose), ``cell_numbers`` (what the cell writes itself), ``reads``
(what is recorded, and the scores); ``namespace_knobs`` turns reads into knobs.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..cell.read import ReadCell, read_cell
from ..cell.source import Transform, parse_cell
from .cell_numbers import cell_knobs
from .knobs import BatchFinding, Knob, KnobKind, Value
from .libraries import found, is_module, resolve, sequence_first
from .namespace_knobs import KNOB_READERS, earlier_tensors, function_defaults
from .provenance import History
from .reader import BodyReader
from .reads import Context, Scan
from .sequence_first import builds_sequence_first, calls_sequence_first, recurrent_states
from .tensors import contracted_dims
from .whole import covers_whole_data


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
    cell: str | ReadCell,
    namespace: Mapping[str, object] | None = None,
    transform: Transform | None = None,
    *,
    history: list[str] | None = None,
    cell_number: int | None = None,
) -> BatchFinding:
    """Every place the failed cell's batch size may live, most plausible first (see the module docstring).

    ``cell``: its source, or the cell as ``%oomfix`` read it (``cell.read``). ``namespace`` is the user's;
    ``history`` IPython's raw input history (``In``: index ``k`` holds ``In[k]``) and ``cell_number`` the
    failed cell's ``k`` (cells from it on are ignored). ``transform`` turns IPython input into Python (the
    shell's ``transform_cell``; IPython's own by default). Never raises for bad input: ``problem`` says
    what is wrong.
    """
    read = cell if isinstance(cell, ReadCell) else read_cell(cell, transform)
    source, parsed, transform = read.source, read.parsed, read.transform
    if parsed is None:
        return BatchFinding(source, (), _unreadable(source, transform))
    namespace = namespace if namespace is not None else {}
    scan = Scan(namespace, History(history, cell_number, namespace, transform), transform)
    scan.states = recurrent_states(parsed.tree, namespace)
    scan.contracted = contracted_dims(parsed.tree.body)
    reader = BodyReader(scan, parsed, cell=True)
    reader.read_body(parsed.tree.body)
    sequence_first_input = (
        _feeds_sequence_first_model(scan)
        or builds_sequence_first(parsed.tree, namespace)
        or calls_sequence_first(parsed.tree, set(reader.body.scope.bound_at), namespace)
    )
    context = Context(scan, 1 if sequence_first_input else 0)
    knobs: list[Knob] = cell_knobs(reader.body.numbers, context, parsed)
    for path, seen in list(scan.reads.items()):
        value = resolve(namespace, path)
        if not found(value):
            continue
        for knob_reader in KNOB_READERS:
            try:
                made = knob_reader(path, value, seen, context)
            except Exception:  # noqa: BLE001  a user object whose attributes raise holds no batch we can change
                continue
            if made:
                knobs.extend(made)
                break
    knobs.extend(function_defaults(context))
    knobs.extend(earlier_tensors(context))
    notes = tuple(f"{k.label.rsplit('.batch_size', 1)[0]}: {k.problem}" for k in knobs if k.problem)
    ranked = sorted(
        _merge([k for k in knobs if k.score > 0 or k.problem]),
        key=lambda k: (-k.score if k.changeable else 1, k.line or parsed.body_line),
    )
    whole = covers_whole_data(BatchFinding(source, tuple(ranked)), namespace, transform, read)
    if not any(k.changeable for k in ranked):
        problem = (
            "no batch size in the cell: no integer named or used like a batch size, no tensor with a literal "
            "batch dimension, no DataLoader, Trainer, config or tensor with written rows it reads from an "
            "earlier cell"
        )
        return BatchFinding(source, tuple(ranked), problem, parsed.body_line, notes, whole, True)
    return BatchFinding(source, tuple(ranked), None, parsed.body_line, notes, whole, True)


def _unreadable(source: str, transform: Transform) -> str:
    """Why a cell that does not parse as IPython runs it has no batch we can change."""
    try:
        parse_cell(source, transform)
    except SyntaxError as error:
        return f"the cell does not parse ({error.msg}, line {error.lineno}), so its batch size cannot be changed"
    except Exception as error:  # noqa: BLE001  IPython's transformer on odd input
        return f"the cell could not be read as IPython input ({error}), so its batch size cannot be changed"
    return "the cell could not be read, so its batch size cannot be changed"


def _feeds_sequence_first_model(scan: Scan) -> bool:
    for path, read in scan.reads.items():
        if read.called or "forward" in read.methods:
            value = resolve(scan.namespace, path)
            if found(value) and is_module(value) and sequence_first(value):
                return True
    return False
