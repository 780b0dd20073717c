"""Reruns leave no trace in what a cell trains: the modules, optimizers, LR schedulers and GradScalers the
cell reads (followed through the notebook's functions, methods and a few levels of attributes) are copied
to the host once and put back before each rerun (``Restorer``), as one run of the cell that fitted leaves
them; the same walk finds the plain state the cell may change (``plain_state``).
"""

from __future__ import annotations

import functools
import itertools
import types
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar, cast

from ..cell.names import code_names
from ..cell.read import ReadCell
from ..errors import CudaMemError
from ..ipython_names import is_ipython_name
from ..sources import torch_state
from ..sources.torch_state import StateKind
from .plain_state import CONTAINERS, PlainState

if TYPE_CHECKING:
    import torch

Returned = TypeVar("Returned")

# Attributes and items are followed this many levels below a name the cell reads (a Trainer's
# ``accelerator.scaler`` is two), and at most this many of each object's.
_DEPTH = 3
_WIDTH = 200

# The host copy may take at most this share of the host memory available: the reruns need some too, and a
# copy that pushes the kernel into swap costs more than the steps it would undo.
HOST_SHARE = 0.8


@dataclass
class TrainingState:
    """The training state a cell reads, found in the namespace (nothing copied yet)."""

    parameters: list[torch.Tensor] = field(default_factory=list)  # module parameters and leaf tensors that require grad
    buffers: list[torch.Tensor] = field(default_factory=list)
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    schedulers: list[torch.optim.lr_scheduler.LRScheduler] = field(default_factory=list)
    scalers: list[torch.amp.GradScaler] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)  # how each object was reached: ``model``, ``trainer.model``
    plain: PlainState = field(default_factory=PlainState)  # the lists, counters... the cell reads (``plain_state``)

    @property
    def empty(self) -> bool:
        return not (self.parameters or self.buffers or self.optimizers or self.schedulers or self.scalers)

    @property
    def nbytes(self) -> int:
        """What the host copy takes: parameters with their ``.grad``, buffers, optimizer state tensors."""
        return (sum(torch_state.parameter_bytes(p) for p in self.parameters)
                + sum(torch_state.tensor_bytes(b) for b in self.buffers)
                + sum(torch_state.optimizer_bytes(o) for o in self.optimizers))

    def describe(self) -> str:
        """The names it was found under, for messages: ``model, optimizer, scheduler``."""
        return ", ".join(self.paths)


class _Finder:
    def __init__(self, namespace: Mapping[str, object], skip: Iterable[str]):
        self.namespace = namespace
        self.skip = set(skip)
        self.state = TrainingState()
        self._seen: set[int] = set()
        self._names: set[str] = set()
        self._tensors: set[int] = set()

    def name(self, name: str) -> None:
        # IPython's own names are not the user's state (``get_ipython`` would lead to the whole shell).
        if name in self._names or name in self.skip or name not in self.namespace or is_ipython_name(name):
            return
        self._names.add(name)
        value = self.namespace[name]
        self.state.plain.bind(name)
        self.visit(value, name, 0, plain=True)

    def _add_tensor(self, tensor: torch.Tensor, into: list[torch.Tensor]) -> None:
        if id(tensor) not in self._tensors:
            self._tensors.add(id(tensor))
            into.append(tensor)

    def _notebook_owned(self, value: object) -> bool:
        """A function or class the notebook defined (its globals are the namespace we search)."""
        if isinstance(value, types.FunctionType):
            return value.__globals__ is self.namespace
        return isinstance(value, type) and value.__module__ == self.namespace.get("__name__", "__main__")

    def visit(self, value: object, path: str, depth: int, plain: bool = False) -> None:
        """Follow ``value`` for torch's objects; ``plain``: reached through plain values only."""
        atoms = (str, bytes, int, float, bool, complex, types.ModuleType)
        if id(value) in self._seen or value is None or value is self.namespace or isinstance(value, atoms):
            return
        self._seen.add(id(value))
        kind = torch_state.kind_of(value)
        if kind is not None:
            self._found(value, kind, path, depth)
            if plain and kind is StateKind.MODULE and self._notebook_owned(type(value)):
                self._keep_module_containers(value, path)
            return
        if torch_state.is_tensor(value):
            return  # a tensor nothing trains: a rerun may bind it again, never step it
        if isinstance(value, types.FunctionType):
            self._visit_function(value, path, depth)
            return
        if isinstance(value, (types.MethodType, functools.partial, type)):
            self._visit_callable(value, path, depth)
            return
        plain = plain and self.state.plain.keep(value, path, self._notebook_owned(type(value)))
        if depth >= _DEPTH:
            return
        self.visit(type(value), path, depth)  # a notebook class's methods read its globals
        for item_path, item in _items(value, path):
            self.visit(item, item_path, depth + 1, plain)

    def _keep_module_containers(self, module: object, path: str) -> None:
        """A notebook's module's public containers (Lightning's ``self.validation_step_outputs``) are plain."""
        for name, attribute in itertools.islice(vars(module).items(), _WIDTH):
            if not name.startswith("_") and isinstance(attribute, CONTAINERS):
                self.state.plain.keep(attribute, f"{path}.{name}", False)

    def _visit_function(self, function: types.FunctionType, path: str, depth: int) -> None:
        """A function: the names a notebook's own reads, what its closure keeps, its defaults."""
        if self._notebook_owned(function):
            for name in sorted(code_names(function.__code__)):
                self.name(name)
        for cell in function.__closure__ or ():
            try:
                self.visit(cell.cell_contents, path, depth + 1)
            except ValueError:  # an empty cell
                pass
        for default in (function.__defaults__ or ()) + tuple((function.__kwdefaults__ or {}).values()):
            self.visit(default, path, depth + 1, plain=self._notebook_owned(function))

    def _visit_callable(self, value: types.MethodType | functools.partial[object] | type, path: str, depth: int) -> None:
        """A bound method, a partial (its function and arguments), a class (the members of a notebook's own)."""
        if isinstance(value, types.MethodType):
            self.visit(value.__self__, path, depth)
            self.visit(value.__func__, path, depth)
        elif isinstance(value, functools.partial):
            for part in (value.func, *value.args, *value.keywords.values()):
                self.visit(part, path, depth + 1)
        elif self._notebook_owned(value):
            for member in list(vars(value).values())[:_WIDTH]:
                self.visit(member, path, depth)

    def _found(self, value: object, kind: StateKind, path: str, depth: int) -> None:
        """``kind`` is ``torch_state.kind_of(value)``: what ``value`` was found to be."""
        state = self.state
        if kind is StateKind.MODULE:
            parameters, buffers = torch_state.module_tensors(cast("torch.nn.Module", value))
            for parameter in parameters:
                self._add_tensor(parameter, state.parameters)
            for buffer in buffers:
                self._add_tensor(buffer, state.buffers)
        elif kind is StateKind.LEAF_TENSOR:
            self._add_tensor(cast("torch.Tensor", value), state.parameters)
        elif kind is StateKind.OPTIMIZER:
            optimizer = cast("torch.optim.Optimizer", value)
            state.optimizers.append(optimizer)
            for parameter in torch_state.optimizer_parameters(optimizer):
                self._add_tensor(parameter, state.parameters)
        elif kind is StateKind.SCHEDULER:
            state.schedulers.append(cast("torch.optim.lr_scheduler.LRScheduler", value))
            scheduled = torch_state.scheduler_optimizer(value)
            if scheduled is not None:
                self.visit(scheduled, f"{path}.optimizer", depth + 1)
        elif kind is StateKind.GRAD_SCALER:
            state.scalers.append(cast("torch.amp.GradScaler", value))
        state.paths.append(path)


def _items(value: object, path: str) -> list[tuple[str, object]]:
    """The first ``_WIDTH`` items of a mapping or collection, or attributes of another object, with their
    paths; none where reading them fails (a user's class may raise anything)."""
    try:
        if isinstance(value, Mapping):
            return [(f"{path}[{k!r}]", v) for k, v in itertools.islice(value.items(), _WIDTH)]
        if isinstance(value, (list, tuple, set, frozenset)):
            return [(f"{path}[{i}]", v) for i, v in enumerate(itertools.islice(iter(value), _WIDTH))]
        return [(f"{path}.{k}", v) for k, v in itertools.islice(vars(value).items(), _WIDTH)]
    except Exception:  # noqa: BLE001 - TypeError where there is no __dict__; anything a user's class raises
        return []


def training_state(namespace: Mapping[str, object], reads: Iterable[str],
                   bound_again: Iterable[str] = ()) -> TrainingState:
    """The training state a cell that reads ``reads`` reads from ``namespace``; the old objects of
    ``bound_again`` (bound by the cell before it reads them) are not followed."""
    finder = _Finder(namespace, bound_again)
    for name in reads:
        finder.name(name)
    return finder.state


def copy_fits(nbytes: int, available_bytes: int | None) -> bool:
    """Whether a host copy of ``nbytes`` fits in ``HOST_SHARE`` of what the host has (unknown: it does)."""
    return available_bytes is None or nbytes <= HOST_SHARE * available_bytes


@dataclass
class _Saved:
    parameters: list[tuple[torch.Tensor, torch.Tensor | None]]
    buffers: list[torch.Tensor]
    optimizers: list[torch_state.SavedOptimizer]
    schedulers: list[dict[str, object]]
    scalers: list[dict[str, object]]
    random: torch_state.SavedRandomState


class Restorer:
    """Copies ``state`` to the host once (``take``) and puts its values back before each rerun wrapped by
    ``run`` (``restore``: nothing when none ran since); ``finish`` drops the copy, putting it back exactly
    where the last rerun failed (it may have stepped before it failed)."""

    def __init__(self, state: TrainingState, namespace: MutableMapping[str, object] | None = None,
                 copy_training: bool = True):
        """``namespace``: where the plain state's names are put back (``None``: not put back);
        ``copy_training``: whether the torch state is copied."""
        self.state = state
        self.namespace = namespace
        self.copy_training = copy_training
        self._trained = state if copy_training else TrainingState()  # what the host copy holds
        self.unrestored: list[str] = []  # plain values that could not be put back, with why
        self._saved: _Saved | None = None
        self._changed = False  # a rerun has run since the copy was last put back
        self._kept_memory = False  # the last put back kept what the run before it made
        self.restores = 0  # how many times the copy was put back
        self._held: list[torch_state.HeldUntilStep] = []  # optimizer state kept for the next step

    def take(self) -> None:
        state = self._trained
        if self.namespace is not None:
            self.unrestored.extend(self.state.plain.save(self.namespace))
        self._saved = _Saved(
            parameters=[torch_state.save_parameter(p) for p in state.parameters],
            buffers=[torch_state.save_buffer(b) for b in state.buffers],
            optimizers=[torch_state.save_optimizer(o) for o in state.optimizers],
            schedulers=[torch_state.save_scheduler(s) for s in state.schedulers],
            scalers=[torch_state.save_grad_scaler(s) for s in state.scalers],
            random=torch_state.save_random_state(),
        )
        self._changed = False

    def run(self, run_source: Callable[[str], Returned]) -> Callable[[str], Returned]:
        def rerun(source: str) -> Returned:
            self._changed = True
            return run_source(source)

        return rerun

    def restore(self) -> None:
        """Before a rerun: the values go back, and what the last run made that the copy lacks (a first
        step's optimizer state, ``.grad``) stays allocated, as at the start of the cell's next run."""
        if self._changed:
            self._put_back(keep_memory=True)

    def _put_back(self, keep_memory: bool, plain: bool = True) -> None:
        saved = self._saved
        if saved is None:
            return
        self._kept_memory = keep_memory
        if self.namespace is not None and plain:
            # First: a list a rerun appended its tensors to lets go of them.
            for failed in self.state.plain.restore(self.namespace):
                if failed not in self.unrestored:
                    self.unrestored.append(failed)
        state = self._trained
        # Optimizers first: their old moments are freed before parameters and .grad are written.
        self._restore_optimizers(state, saved, keep_memory)
        for parameter, saved_parameter in zip(state.parameters, saved.parameters):
            torch_state.restore_parameter(parameter, saved_parameter, keep_memory)
        for buffer, saved_buffer in zip(state.buffers, saved.buffers):
            torch_state.restore_buffer(buffer, saved_buffer)
        for scheduler, saved_scheduler in zip(state.schedulers, saved.schedulers):
            torch_state.restore_scheduler(scheduler, saved_scheduler)
        for scaler, saved_scaler in zip(state.scalers, saved.scalers):
            torch_state.restore_grad_scaler(scaler, saved_scaler)
        torch_state.restore_random_state(saved.random)
        self._changed = False
        self.restores += 1

    def _restore_optimizers(self, state: TrainingState, saved: _Saved, keep_memory: bool) -> None:
        """Put each optimizer's state back; with ``keep_memory``, hold what the last run made for its next step."""
        held = [h for h in self._held if h.holding]  # a run that never stepped still holds the last's
        for stepped in (h for h in self._held if not h.holding):
            stepped.release()
        for optimizer, saved_optimizer in zip(state.optimizers, saved.optimizers):
            kept = torch_state.restore_optimizer(optimizer, saved_optimizer, keep_memory)
            if kept is not None:
                held.append(kept)
        self._held = held

    def held_for_step(self) -> list[torch.Tensor]:
        """The tensors held until an optimizer's next step begins (see ``restore``)."""
        return [tensor for held in self._held for tensor in held.tensors]

    def finish(self, last_fitted: bool) -> None:
        """The end: after a failed last rerun the copy goes back exactly; what is held for a next step goes."""
        if not last_fitted and (self._changed or self._kept_memory):
            # With no rerun since, the notebook's values may have been set since (the knob at the best batch).
            self._put_back(keep_memory=False, plain=self._changed)
        while self._held:
            self._held.pop().release()
        self._saved = None
        self.state.plain.drop()


def what_to_restore(cell: ReadCell, namespace: Mapping[str, object], no_restore: bool,
                    can_ask: bool) -> tuple[TrainingState, bool, str | None]:
    """What the cell trains and reads, whether its host copy is to be taken, and why not where it would not
    fit in host memory (raised, asking for --no-restore, where nobody can be asked: ``can_ask`` false)."""
    from ..sources.host import available_bytes
    from ..units import format_bytes

    if cell.parsed is None:
        return TrainingState(), False, None  # a cell that does not parse reruns to fail as it did
    trained = training_state(namespace, cell.reads, cell.binds_first)
    if no_restore:
        trained.plain = PlainState()  # nothing is put back, plain values included
        return trained, False, None
    if trained.empty:
        return trained, False, None
    available = available_bytes()
    if copy_fits(trained.nbytes, available):
        return trained, True, None
    too_large = (
        f"the model and optimizer state the cell trains ({trained.describe()}) takes "
        f"{format_bytes(trained.nbytes)}, more than the host can copy ({format_bytes(available)} available), "
        "so it cannot be put back before each rerun: every rerun's training steps would stay"
    )
    if not can_ask:
        raise CudaMemError(f"{too_large}; add --no-restore to rerun anyway")
    return trained, False, too_large
