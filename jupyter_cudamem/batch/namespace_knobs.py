"""From what the failed cell reads in the namespace to knobs: one function per kind of knob.

Each function (``KNOB_READERS``) looks at one path the cell read, its value now and how it was read
(``reads.Read``), and says whether it is a batch and where it lives: an int named or used as a batch,
a DataLoader the cell iterates or passes on, a Hugging Face ``Trainer`` or ``TrainingArguments``, a
Lightning holder, a config handed to code we cannot read, a dict of loaders, a ``functools.partial``
the cell calls with a batch among the arguments it binds. The next kind of knob is
one more function here. Also here: defaults of notebook functions the cell calls, and the rows of
tensors from earlier cells that it feeds whole to a model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

from .knobs import Bound, Default, Knob, KnobKind, LiveTarget, Loader, ObjectPath, Rows, Step, Trace, TrainerArgs, Value
from .libraries import (
    batch_fields,
    bound_arguments,
    found,
    is_config_like,
    is_module,
    is_dataloader,
    is_hf_trainer,
    is_lightning_holder,
    is_training_arguments,
    lightning_batch_paths,
    loader_batch_size,
    loader_problem,
    resolve,
    settable,
)
from .names import name_score
from .reads import (
    AUTHORITATIVE,
    DIRECT_BONUS,
    PHASE_PENALTY,
    STATE_BATCH,
    USE_SCORES,
    Context,
    Read,
    Use,
    phase_penalty,
)
from .tensors import tensor_shape, trace_rows


def _evidence(read: Read, uses: Iterable[Use]) -> tuple[str, ...]:
    evidence = tuple(u.value for u in sorted(uses, key=lambda u: -USE_SCORES.get(u, 0)) if u in USE_SCORES)
    if not read.direct and read.readers:
        evidence += (f"read by {', '.join(sorted(read.readers))}()",)
    return evidence


def _batch_uses(read: Read, context: Context) -> set[Use]:
    uses = set(read.uses) - {Use.PRINTED, Use.OTHER, Use.MATMUL}
    if context.batch_dimension in read.dims or STATE_BATCH in read.dims:
        uses.add(Use.DIMENSION)
    return uses


def _traced(context: Context, path: ObjectPath, value: int) -> Trace:
    trace = context.scan.history.trace(path, value)
    return trace if trace is not None else Trace((), "set in an earlier cell")


def _via(trace: Trace, context: Context) -> tuple[LiveTarget, ...]:
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


def _integer(path: ObjectPath, value: object, read: Read, context: Context) -> list[Knob]:
    """An int the cell reads, named or used as a batch: a variable, or a field of a config (a batch of 1 too:
    the plan measures it; a fix says it cannot shrink)."""
    if type(value) is not int or value < 1:
        return []
    uses = {u for u in _batch_uses(read, context) if u in USE_SCORES}  # iterated or passed on says nothing of an int
    named = name_score(path.last_name)
    if not named and not uses:
        return []
    if read.uses <= {Use.PRINTED}:
        return []  # only printed or logged: changing it changes no memory
    if path.steps:
        parent = resolve(context.scan.namespace, ObjectPath(path.root, path.steps[:-1]))
        if not settable(parent, path.steps[-1]):
            return []
    score = named + max((USE_SCORES.get(u, 0) for u in uses), default=0) + (DIRECT_BONUS if read.direct else 0)
    score -= phase_penalty(path.text, context)
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
            through=trace.through,
        )
    ]


def _dataloader(path: ObjectPath, value: object, read: Read, context: Context) -> list[Knob]:
    """A DataLoader the cell iterates or hands on: rebuilt with the new batch size."""
    if not is_dataloader(value) or not (read.uses & {Use.ITERATED, Use.ARGUMENT}):
        return []
    size = loader_batch_size(value)
    problem = loader_problem(value)
    label = f"{path.text}.batch_size"
    if size is None:
        return [Knob(label, 0, KnobKind.DATALOADER, "value", 0, (), (), "", (), problem or "it has no batch size")]
    iterated_here = read.direct and Use.ITERATED in read.uses
    score = AUTHORITATIVE + (DIRECT_BONUS if iterated_here else 0) - phase_penalty(path.text, context)
    trace = _loader_trace(context, path, value, size)
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
            through=trace.through,
        )
    ]


def _loader_trace(context: Context, path: ObjectPath, loader: object, size: int) -> Trace:
    """Where a loader's batch is written. A loader batched by its ``batch_sampler`` has it in the sampler
    (``BatchSampler(sampler, batch_size=256, ...)``), and DataLoader refuses a ``batch_size=`` beside
    ``batch_sampler=``; a prepared loader batches that way too, from the ``batch_size=`` of the loader it
    was prepared from, which the trace reaches through the preparing call."""
    if getattr(loader, "batch_size", None) is not None:
        return _traced(context, path.attribute("batch_size"), size)
    in_sampler = _traced(context, path.attribute("batch_sampler").attribute("batch_size"), size)
    if in_sampler.written:
        return in_sampler
    traced = _traced(context, path.attribute("batch_size"), size)
    return replace(traced, written=tuple(w for w in traced.written if w.insert is None))


def _hf_trainer(path: ObjectPath, value: Any, read: Read, context: Context) -> list[Knob]:
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
                through=trace.through,
            )
        )
    return knobs


def _training_arguments(path: ObjectPath, value: object, read: Read, context: Context) -> list[Knob]:
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
            through=trace.through,
        )
    ]


def _lightning(path: ObjectPath, value: object, read: Read, context: Context) -> list[Knob]:
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
            through=trace.through,
        )
    ]


def _config(path: ObjectPath, value: object, read: Read, context: Context) -> list[Knob]:
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
        score = name_score(field_path.last_name) - 2 - phase_penalty(field_path.text, context)
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
                through=trace.through,
            )
        )
    return knobs


def _bound(path: ObjectPath, value: object, read: Read, context: Context) -> list[Knob]:
    """A ``functools.partial`` the cell (or code it calls) calls, binding an argument named like a batch size
    (``make_loader = partial(DataLoader, batch_size=128)``): passed as a batch size on every call."""
    if not read.called:
        return []
    knobs = []
    for parameter, (size, _) in bound_arguments(value).items():
        named = name_score(parameter)
        if type(size) is not int or size < 2 or not named:
            continue
        score = named + USE_SCORES[Use.BATCH_ARGUMENT] + (DIRECT_BONUS if read.direct else 0)
        trace = _traced(context, path.attribute(parameter), size)
        knobs.append(
            Knob(
                f"{parameter} (bound by {path.text})",
                size,
                KnobKind.BOUND,
                "value",
                score - phase_penalty(parameter, context),
                trace.written,
                (Bound(path, parameter),) + _via(trace, context),
                trace.origin,
                (f"{path.text}(...) is called",),
                through=trace.through,
            )
        )
    return knobs


def _loader_collection(path: ObjectPath, value: object, read: Read, context: Context) -> list[Knob]:
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
            item_read = Read(uses=set(read.element_uses), direct=read.direct, readers=set(read.readers))
            knobs += _dataloader(path.child(Step(key, key=True)), item, item_read, context)
    return knobs


# One function per kind of knob; the first that recognises a value decides what it is.
KNOB_READERS: tuple[Callable[[ObjectPath, Any, Read, Context], list[Knob]], ...] = (
    _hf_trainer,
    _training_arguments,
    _dataloader,
    _loader_collection,
    _bound,
    _lightning,
    _integer,
    _config,
)


def function_defaults(context: Context) -> list[Knob]:
    """Defaults of notebook functions the cell calls without that argument (``def train(..., bs=64)``)."""
    knobs = []
    for function_path, parameter, value, uses in context.scan.defaults:
        function = resolve(context.scan.namespace, function_path)
        score = name_score(parameter) + max((USE_SCORES.get(u, 0) for u in uses), default=0)
        trace = context.scan.history.default_of(
            getattr(function, "__name__", function_path.last_name), parameter, value
        )
        knobs.append(
            Knob(
                f"{parameter} (default of {function_path.text}())",
                value,
                KnobKind.DEFAULT,
                "default",
                score - phase_penalty(parameter, context),
                trace.written if trace else (),
                (Default(function_path, parameter),),
                trace.origin if trace else "",
                tuple(u.value for u in uses if u in USE_SCORES),
            )
        )
    return knobs


def _batch_dim(path: ObjectPath, rank: int, context: Context) -> int:
    """A tensor's batch dimension: the second of an RNN's (layers, batch, hidden) states, the context's for
    three or more dimensions, else the first."""
    if rank == 3 and path.root in context.scan.states:
        return 1
    return context.batch_dimension if rank >= 3 else 0


def _rows_trace(context: Context, tensors: list[tuple[ObjectPath, int]], rows: int) -> Trace:
    """Where the first tensor's rows are written in a cell, else the first of the others' that is."""
    first, dim = tensors[0]
    trace = trace_rows(context.scan.history, first, dim, rows)
    if not trace.written:
        for other, other_dim in tensors[1:]:
            alternative = trace_rows(context.scan.history, other, other_dim, rows)
            if alternative.written:
                return alternative
    return trace


def _tensors_read(
    context: Context,
) -> tuple[dict[int, list[tuple[ObjectPath, int]]], dict[int, list[ObjectPath]], set[int]]:
    """The earlier cells' tensors the cell reads, by rows: those fed whole to a module (with their batch
    dimension), those beside them (by their leading dimension, unless a matrix product sums over it), and
    the sides of the square matrices it reads. A module's buffer is the model's, not the data's."""
    fed: dict[int, list[tuple[ObjectPath, int]]] = {}
    beside: dict[int, list[ObjectPath]] = {}
    square: set[int] = set()
    for path, read in context.scan.reads.items():
        if read.uses <= {Use.PRINTED}:
            continue
        value = resolve(context.scan.namespace, path)
        shape = tensor_shape(value) if found(value) else None
        if not shape or (path.steps and is_module(resolve(context.scan.namespace, ObjectPath(path.root)))):
            continue
        rank = len(shape)
        if rank == 2 and shape[0] == shape[1]:
            square.add(shape[0])
        dim = _batch_dim(path, rank, context)
        if read.direct and read.fed and rank >= 2 and shape[dim] >= 2:
            fed.setdefault(shape[dim], []).append((path, dim))
        elif shape[0] >= 2 and -rank not in context.scan.contracted.get(path.text, set()):
            beside.setdefault(shape[0], []).append(path)
    return fed, beside, square


def earlier_tensors(context: Context) -> list[Knob]:
    """Tensors from earlier cells the cell feeds whole to a module (``model(inputs)``), one knob per batch:
    their batch dimension, cut together with every other tensor the cell (or code it calls) reads whose
    leading dimension has as many rows (labels, targets, masks, weights per sample), however it reads them:
    cut alone, ``inputs`` no longer matches ``targets`` in ``(model(inputs) - targets) ** 2``. A dimension a
    matrix product sums over is not such a row; a square tensor of that side (an adjacency matrix) cannot
    be cut by its rows alone, so then nothing is. Only where the rows are written in a cell (a
    constructor's dimension, or the variable it was given)."""
    fed, beside, square = _tensors_read(context)
    knobs = []
    for rows, tensors in fed.items():
        if rows in square:
            continue
        tensors.sort(key=lambda t: t[0].text)
        first, dim = tensors[0]
        trace = _rows_trace(context, tensors, rows)
        if not trace.written:
            # Rows taken from elsewhere (``images, labels = next(iter(loader))``): the cell may index them by a
            # count of its own (``for i in range(4)``), so cutting them is not safe to guess.
            continue
        written = list(trace.written)
        through = list(trace.through)
        for other, other_dim in tensors[1:] + [(p, 0) for p in sorted(beside.get(rows, []), key=lambda p: p.text)]:
            traced = trace_rows(context.scan.history, other, other_dim, rows)
            written += [w for w in traced.written if w not in written]
            through += [c for c in traced.through if c not in through]
        live = tuple(Rows(p, d) for p, d in tensors) + tuple(Rows(p) for p in beside.get(rows, []))
        score = USE_SCORES[Use.DIMENSION] + DIRECT_BONUS - phase_penalty(first.text, context)
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
                through=tuple(through),
            )
        )
    return knobs
