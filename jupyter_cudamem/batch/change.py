"""Change a batch size where it lives for one try, put it back if no try fits, and show what to edit.

The finder says where a knob lives (``knobs.Knob``); this module changes it there:

- a number written in the failed cell: the cell's text is rewritten at that number (``cell.edit``);
- a variable, a dict key, an attribute of a config or dataclass: the value is set in place (a frozen
  dataclass too, as ``dataclasses.replace`` would build it);
- a DataLoader: rebuilt from its own attributes with the new batch size and everything else kept
  (dataset, sampler, so shuffling, collate_fn, workers, pin_memory, drop_last, generator...), and
  bound where the old one was; a loader ``accelerate`` prepared (a wrapper bound to the device and the
  processes, or an older accelerate's ``DataLoader`` subclass taking other arguments) cannot be rebuilt
  without its ``Accelerator``, so the stock ``BatchSampler`` it batches with gets the new size in place;
- a Hugging Face ``Trainer``: ``args.per_device_*_batch_size`` and the training batch the Trainer
  copied from them when it was built (``_train_batch_size``, which ``train()`` reads);
- a notebook function's default: its ``__defaults__``/``__kwdefaults__``;
- an argument a ``functools.partial`` binds: a new partial with it changed, bound where the old one was;
- a tensor made in an earlier cell whose rows are the batch: bound to its first rows (a view, so no
  memory is copied) or, for a larger batch, to its rows repeated (``resized_rows``).

Every value changed is remembered the first time, so ``restore()`` puts back exactly what was there.
``diffs(value)`` gives one diff per cell whose text should change (earlier ``In[k]`` and the failed
cell), ``paste_code(value)`` the code a user pastes to keep the change: the changed cells and, in order,
the unchanged cells that carry the batch from them to where it lives (``Knob.reruns``: the cell that
built the loader from the variable, the cell that prepared the loader). Nothing is changed silently:
the caller shows these.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

from ..cell.edit import CellDiff, Edit, apply_edits, insert_line
from ..errors import CudaMemError
from .knobs import BatchFinding, Bound, Default, Knob, LiveTarget, Loader, ObjectPath, Rows, TrainerArgs, Value
from .libraries import bound_arguments, class_names, found, loader_batch_size, loader_problem, resolve, wrapped_loader

# DataLoader's keyword arguments that its attributes keep, as the constructor takes them back.
_LOADER_SETTINGS = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "drop_last",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


def rebuilt_loader(loader: Any, batch_size: int) -> object:
    """A new loader like ``loader`` but batching ``batch_size`` items. Raises ``CudaMemError`` when the
    loader's batches come from somewhere else (a custom ``batch_sampler``) or its class takes other arguments."""
    problem = loader_problem(loader)
    if problem is not None:
        raise CudaMemError(f"cannot rebuild the DataLoader: {problem}")
    cls = type(loader)
    parameters = _loader_parameters(cls)
    if parameters is None:
        raise CudaMemError(f"cannot rebuild the DataLoader: {cls.__name__} takes other arguments than DataLoader does")
    settings = {
        name: getattr(loader, name) for name in _LOADER_SETTINGS if name in parameters and hasattr(loader, name)
    }
    if not settings.get("num_workers"):
        settings.pop("prefetch_factor", None)  # DataLoader refuses a prefetch_factor without workers
        settings.pop("persistent_workers", None)
        settings.pop("multiprocessing_context", None)
    if loader.batch_size is None:  # a stock BatchSampler passed as batch_sampler=
        old = loader.batch_sampler
        settings.pop("drop_last", None)
        settings["batch_sampler"] = type(old)(old.sampler, batch_size, old.drop_last)
    else:
        settings["batch_size"] = batch_size
        if "IterableDataset" not in class_names(loader.dataset):
            settings["sampler"] = loader.sampler  # RandomSampler when it shuffled, with its generator
    return cls(loader.dataset, **settings)


def _loader_parameters(cls: type) -> Mapping[str, inspect.Parameter] | None:
    """The parameters of a loader class that takes DataLoader's own, or ``None`` (a wrapper such as an older
    accelerate's ``DataLoaderShard``, built from a device and ``**kwargs``)."""
    try:
        parameters = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return None
    return parameters if {"dataset", "batch_size", "sampler", "batch_sampler"} <= set(parameters) else None


def rebound(bound: functools.partial, parameter: str, value: int) -> functools.partial:
    """A partial like ``bound`` but binding ``value`` for ``parameter`` (a keyword, or one of its ``args``)."""
    position = bound_arguments(bound).get(parameter, (None, None))[1]
    if position is None:
        return functools.partial(bound.func, *bound.args, **{**bound.keywords, parameter: value})
    args = list(bound.args)
    args[position] = value
    return functools.partial(bound.func, *args, **bound.keywords)


def resized_rows(tensor: Any, dim: int, rows: int) -> object:
    """``tensor`` with ``rows`` entries along ``dim``: its first ones (a view of the same memory), or, for
    more than it has, its own repeated and cut (a new tensor of exactly that size). A tensor that needs
    no gradient stays a leaf, so a cell calling ``requires_grad_()`` on it still can."""
    size = int(tensor.shape[dim])
    if rows <= size:
        resized = tensor.detach().narrow(dim, 0, rows)
    else:
        times = -(-rows // size)
        repeats = [times if d == dim else 1 for d in range(tensor.dim())]
        resized = tensor.detach().repeat(*repeats).narrow(dim, 0, rows).clone()
    return resized.requires_grad_() if tensor.requires_grad else resized


class BatchChange:
    """One knob of a finding, changed for each try: ``apply(batch)`` returns the source to run."""

    def __init__(
        self,
        finding: BatchFinding,
        knob: Knob | None = None,
        namespace: MutableMapping[str, object] | None = None,
        history: Sequence[str] | None = None,
    ):
        chosen = knob or finding.chosen
        if chosen is None:
            raise ValueError("nothing to change: " + finding.summary())
        self.finding = finding
        self.knob: Knob = chosen
        self.namespace = namespace if namespace is not None else {}
        self.history = list(history or [])
        self._undo: dict[LiveTarget, Callable[[], None]] = {}
        self._originals: dict[LiveTarget, object] = {}
        self.applied: int | None = None

    # -- one try -----------------------------------------------------------------------------------
    def apply(self, batch: int) -> str:
        """Set the batch to ``batch`` everywhere it lives; return the failed cell's source for this try.
        Raises ``CudaMemError`` (with what could not be changed) and leaves nothing half-changed."""
        if batch < 1:
            raise ValueError(f"a batch size must be at least 1, got {batch}")
        try:
            for target in self.knob.live:
                self._set(target, batch)
        except CudaMemError:
            self.restore()
            raise
        except Exception as error:
            self.restore()
            raise CudaMemError(f"could not set {self.knob.label} to {batch}: {type(error).__name__}: {error}") from None
        self.applied = batch
        return self.source_for(batch)

    def source_for(self, batch: int) -> str:
        """The failed cell with its own numbers of this knob changed to ``batch`` (unchanged when it has none)."""
        edits = [Edit(w.span, w.text_for(batch)) for w in self.knob.written if w.cell is None]
        return apply_edits(self.finding.source, edits) if edits else self.finding.source

    def restore(self) -> None:
        """Put back every value ``apply`` changed, as it was before the first try."""
        for undo in reversed(list(self._undo.values())):
            undo()
        self._undo.clear()
        self._originals.clear()
        self.applied = None

    def forget_originals(self) -> None:
        """Keep what is applied now: a later ``restore()`` goes back to it, not to the original values."""
        self._undo.clear()
        self._originals.clear()

    # -- what to tell the user ---------------------------------------------------------------------
    def diffs(self, batch: int) -> tuple[CellDiff, ...]:
        """One diff per cell whose text sets this knob: earlier ``In[k]`` first, then the failed cell."""
        by_cell: dict[int | None, list[Edit]] = {}
        for written in self.knob.written:
            by_cell.setdefault(written.cell, []).append(Edit(written.span, written.text_for(batch)))
        diffs = []
        for cell in sorted(c for c in by_cell if c is not None):
            if 0 < cell < len(self.history):
                before = str(self.history[cell])
                diffs.append(CellDiff(f"In[{cell}]", before, apply_edits(before, by_cell[cell]), cell))
        if None in by_cell:
            before = self.finding.source
            diffs.append(CellDiff("the failed cell", before, apply_edits(before, by_cell[None]), None))
        return tuple(d for d in diffs if d.changed)

    def reruns(self) -> tuple[int, ...]:
        """Earlier cells to run again, unchanged, after the changed ones (``Knob.reruns``): without them the
        loader, Trainer or prepared object built from the old batch keeps it. Only cells the history holds."""
        if not any(w.cell is not None for w in self.knob.written):
            return ()
        return tuple(c for c in self.knob.reruns if 0 < c < len(self.history))

    def unwritten(self, batch: int) -> tuple[str, ...]:
        """Statements that set what lives outside any cell's text we could find (a computed value, a
        config read from a file): the user keeps the change by running them."""
        if self.knob.written:
            return ()
        return tuple(_statement_for(target, batch) for target in self.knob.live)

    def paste_code(self, batch: int) -> str:
        """The code to paste to keep the batch that fits: the changed cell(s), or statements that set it."""
        diffs = self.diffs(batch)
        statements = self.unwritten(batch)
        reruns = self.reruns()
        if len(diffs) == 1 and diffs[0].cell_number is None and not statements:
            return diffs[0].after
        changed = {d.cell_number: d for d in diffs if d.cell_number is not None}
        order = sorted(set(changed) | set(reruns))
        then = "the failed cell" if not reruns else " and ".join(f"In[{c}]" for c in reruns) + ", then the failed cell"
        parts = []
        for cell in order:
            if cell in changed:
                parts.append(
                    f"# {changed[cell].label} with batch {batch} (was {self.knob.value}): run this in its place, "
                    f"then {then}\n{changed[cell].after.rstrip()}"
                )
            else:
                parts.append(
                    f"# In[{cell}], unchanged: run it again, so that {self.knob.label.split('.')[0]} is built "
                    f"with the new batch\n{str(self.history[cell]).rstrip()}"
                )
        for diff in diffs:
            if diff.cell_number is None:
                parts.append(f"# the failed cell, with the batch that fits\n{diff.after.rstrip()}")
        if statements:
            parts.append("# %oomfix set the batch where it lives; keep it with:\n" + "\n".join(statements))
        return "\n\n".join(parts) + "\n"

    # -- setting one place ------------------------------------------------------------------------
    def _set(self, target: LiveTarget, batch: int) -> None:
        if isinstance(target, Value):
            self._set_value(target, target.path, batch)
        elif isinstance(target, Loader):
            self._set_loader(target, batch)
        elif isinstance(target, TrainerArgs):
            self._set_trainer_args(target, batch)
        elif isinstance(target, Rows):
            tensor = self._get(target.path)
            original = self._original(target, tensor, lambda: self._put(target.path, original))
            self._put(target.path, resized_rows(original, target.dim, batch))
        elif isinstance(target, Bound):
            bound = self._get(target.path)
            original = self._original(target, bound, lambda: self._put(target.path, original))
            self._put(target.path, rebound(original, target.parameter, batch))
        elif isinstance(target, Default):
            function = self._get(target.path)
            defaults, kwdefaults = function.__defaults__, function.__kwdefaults__

            def restore_defaults() -> None:
                function.__defaults__, function.__kwdefaults__ = defaults, kwdefaults

            self._original(target, None, restore_defaults)
            _set_default(function, target.parameter, batch)

    def _set_loader(self, target: Loader, batch: int) -> None:
        loader = self._get(target.path)
        if wrapped_loader(loader) is not None or _loader_parameters(type(loader)) is None:
            # A prepared loader (accelerate's, bound to the device and the processes) cannot be rebuilt
            # without what prepared it; the stock BatchSampler it batches with is changed in place.
            sampler = _stock_batch_sampler(loader)
            size = sampler.batch_size
            self._original(target, None, lambda: setattr(sampler, "batch_size", size))
            sampler.batch_size = batch
            return
        original = self._original(target, loader, lambda: self._put(target.path, original))
        self._put(target.path, rebuilt_loader(original, batch))

    def _set_trainer_args(self, target: TrainerArgs, batch: int) -> None:
        trainer = self._get(target.path)
        args = trainer.args
        old_field = getattr(args, target.field)
        old_copy = getattr(trainer, "_train_batch_size", None)

        def undo() -> None:
            _assign(args, target.field, old_field)
            if old_copy is not None:
                trainer._train_batch_size = old_copy

        self._original(target, None, undo)
        _assign(args, target.field, batch)
        if target.field == "per_device_train_batch_size" and hasattr(trainer, "_train_batch_size"):
            # Trainer copies args.train_batch_size (per-device size x GPUs) when built; train() reads the copy.
            copied = getattr(args, "train_batch_size", batch)
            trainer._train_batch_size = copied if type(copied) is int else batch

    def _original(self, target: LiveTarget, value: object, undo: Callable[[], None]) -> Any:
        """The value before the first try (recorded with how to put it back); later tries reuse it."""
        if target not in self._undo:
            self._undo[target] = undo
            self._originals[target] = value
        return self._originals[target]

    def _set_value(self, target: LiveTarget, path: ObjectPath, batch: int) -> None:
        old = self._get(path)
        self._original(target, old, lambda: self._put(path, old))
        self._put(path, batch)

    def _get(self, path: ObjectPath) -> Any:
        value = resolve(self.namespace, path)
        if not found(value):
            raise CudaMemError(f"{path.text} is no longer in the namespace")
        return value

    def _put(self, path: ObjectPath, value: object) -> None:
        if not path.steps:
            self.namespace[path.root] = value
            return
        parent = self._get(ObjectPath(path.root, path.steps[:-1]))
        step = path.steps[-1]
        if step.key:
            parent[step.name] = value
        else:
            _assign(parent, str(step.name), value)


def live_batch(namespace: Mapping[str, object], target: LiveTarget) -> int | None:
    """The batch a live place holds now (``None`` when it is gone): what a try really ran with."""
    value = resolve(namespace, target.path)
    if not found(value):
        return None
    if isinstance(target, Value):
        return value if type(value) is int else None
    if isinstance(target, Loader):
        return loader_batch_size(value)
    if isinstance(target, TrainerArgs):
        size = getattr(getattr(value, "args", None), target.field, None)
        return size if type(size) is int else None
    if isinstance(target, Rows):
        shape = getattr(value, "shape", None)
        return int(shape[target.dim]) if shape is not None and len(shape) > target.dim else None
    if isinstance(target, Bound):
        size = bound_arguments(value).get(target.parameter, (None, None))[0]
        return size if type(size) is int else None
    try:
        default = inspect.signature(value).parameters[target.parameter].default
    except (TypeError, ValueError, KeyError):
        return None
    return default if type(default) is int else None


def _stock_batch_sampler(loader: object) -> Any:
    """The ``BatchSampler`` a wrapped loader batches with (inside accelerate's ``BatchSamplerShard`` too)."""
    sampler = getattr(loader, "batch_sampler", None)
    while sampler is not None and type(sampler).__name__ != "BatchSampler":
        sampler = getattr(sampler, "batch_sampler", None)
    if sampler is None or type(getattr(sampler, "batch_size", None)) is not int:
        raise CudaMemError(
            f"cannot change the batch of the prepared loader: it batches with "
            f"{type(getattr(loader, 'batch_sampler', None)).__name__}, not a BatchSampler"
        )
    return sampler


def _assign(obj: object, name: str, value: object) -> None:
    try:
        setattr(obj, name, value)
    except AttributeError:
        # A frozen dataclass refuses setattr; its own __init__ sets fields this way.
        object.__setattr__(obj, name, value)


def _set_default(function: types.FunctionType, parameter: str, value: int) -> None:
    code = function.__code__
    positional = code.co_varnames[: code.co_argcount]  # co_argcount counts positional-only ones too
    defaults = list(function.__defaults__ or ())
    first_default = len(positional) - len(defaults)
    if parameter in positional and positional.index(parameter) >= first_default:
        defaults[positional.index(parameter) - first_default] = value
        function.__defaults__ = tuple(defaults)
        return
    if function.__kwdefaults__ and parameter in function.__kwdefaults__:
        function.__kwdefaults__ = {**function.__kwdefaults__, parameter: value}
        return
    raise CudaMemError(f"{function.__name__}() has no default for {parameter}")


def _statement_for(target: LiveTarget, batch: int) -> str:
    if isinstance(target, Value):
        return f"{target.path.text} = {batch}"
    if isinstance(target, Loader):
        return f"# rebuild {target.path.text} with batch_size={batch} (same dataset, sampler and settings)"
    if isinstance(target, TrainerArgs):
        return f"{target.path.text}.args.{target.field} = {batch}  # then build the Trainer again"
    if isinstance(target, Rows):
        rows = f"[:{batch}]" if target.dim == 0 else f".narrow({target.dim}, 0, {batch})"
        return f"{target.path.text} = {target.path.text}{rows}  # or make it again with {batch} rows"
    if isinstance(target, Bound):
        return f"# bind {target.path.text} again with {target.parameter}={batch} (same function and other arguments)"
    return f"{target.path.text}.__defaults__  # {target.parameter}={batch}"


def text_change(finding: BatchFinding, knob: Knob, batch: int) -> str:
    """The failed cell changed so that running it sets the batch: its numbers rewritten, and a variable set
    in an earlier cell assigned on a new first line. For knobs that live only in variables."""
    source = BatchChange(finding, knob).source_for(batch)
    for target in knob.live:
        if not (isinstance(target, Value) and not target.path.steps):
            raise ValueError(f"{knob.label} lives in {knob.kind.value}: it cannot be set by the cell's text")
        source = insert_line(
            source, finding.body_line, f"{target.path.root} = {batch}  # set by %oomfix, was {knob.value}"
        )
    return source
