"""Rerun a cell that ran out of GPU memory until a form of it fits, measuring every try.

Knows nothing of IPython: it is handed a function that runs a cell's source and returns its exception,
a cleanup, and the ``Hardware``. Tries stop at ``max_tries``, at the first try that fits (for the batch
search: once it says a larger batch will not fit), and at any error that is not an OOM.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, replace

from ..errors import CudaMemError
from ..hardware import Hardware, headroom_bytes
from ..units import format_bytes
from ..advice import build_suggestions
from ..attribution.probe import TensorProbe, default_probe
from ..attribution.training_state import fixed_memory
from ..growth import FixedMemory
from ..batch import BatchFinding, find_batch
from ..cell.edit import AutocastNotApplicable, wrap_in_autocast
from ..cell.read import ReadCell
from .cleanup import CleanupResult
from ..reruns.model_state import training_state
from ..reruns.set_aside import Mover, SetAside
from .options import check_max_tries, check_strategies
from .outcome import Outcome, TryResult
from .smaller_batch import BatchTried, SmallerBatch
from .tries import Cleanup, FixTries, RunSource, lacked_bytes, needed_bytes, one_line
from ..oom import OomInfo, oom_device, parse_oom
from .strategies import STRATEGIES, Strategy
from .whole_data import whole_data_decision


def stepping_functions(namespace: Mapping[str, object] | None) -> frozenset[str]:
    """Functions of earlier cells whose code calls ``backward``, ``step`` or ``zero_grad``: a call of one
    stays outside autocast (``wrap_in_autocast``'s ``outside_names``)."""
    return frozenset(
        name for name, value in (namespace or {}).items()
        if isinstance(value, types.FunctionType) and {"backward", "step", "zero_grad"} & set(value.__code__.co_names)
    )


def freed_from_before(rebinds: tuple[str, ...], cleaned: CleanupResult | None) -> tuple[int, list[str]]:
    """What the cleanup freed that was held before the failed cell (bytes, and by whom): the output cache,
    and each variable deleted with ``--del`` that the cell does not bind again (``rebinds``: it made those)."""
    if cleaned is None:
        return 0, []
    freed = {"the output cache": cleaned.freed_output_cache_bytes,
             **{name: size for name, size in cleaned.freed_by_name.items() if name not in rebinds}}
    held = {who: size for who, size in freed.items() if size}
    return sum(held.values()), list(held)


@dataclass(frozen=True)
class _FailedCell:
    """What the strategies read of the failed cell, once: the cell, its OOM and device, where its batch
    lives, what it needs at least and the room it has (bytes, ``None``: unknown), what the cleanup freed."""

    read: ReadCell
    namespace: Mapping[str, object] | None
    oom: OomInfo | None
    device: int
    finding: BatchFinding | None
    need: int | None
    budget: int | None
    cleaned: CleanupResult | None


@dataclass
class Driver:
    """Runs the strategies in order for one failed cell. ``mover``: how what the cell binds again goes to
    the host (``None``: PyTorch's); ``oom_of``: a try's OOM from its exception (``None``: ``parse_oom``)."""

    run_source: RunSource
    hardware: Hardware
    cleanup: Cleanup
    max_tries: int = 3
    strategies: tuple[Strategy, ...] = STRATEGIES
    autocast_dtype: Callable[[], str] | None = None
    margin: float = 0.04
    mover: Mover | None = None
    oom_of: Callable[[BaseException], OomInfo | None] | None = None
    probe: TensorProbe | None = None
    # Puts back what the cell trains before each rerun (``Restorer.restore``); does nothing if none ran since.
    before_rerun: Callable[[], object] | None = None
    # What that put-back holds until the optimizer's next step (``Restorer.held_for_step``).
    held_for_step: Callable[[], Sequence[object]] | None = None

    def __post_init__(self) -> None:
        self.max_tries = check_max_tries(self.max_tries)
        self.strategies = check_strategies(self.strategies)
        # Through lambdas, so that what a caller sets on the driver later (a test's run_source) is used.
        self._runs = FixTries(lambda source: self.run_source(source), self.hardware, lambda error: self.cleanup(error),
                              self.max_tries, self.mover, self.oom_of, self._put_back,
                              held_for_step=self.held_for_step)
        self._history: Sequence[str] | None = None
        self._fixed: FixedMemory | None = None  # what the cell's step holds whatever its batch

    @staticmethod
    def _trained_ids(cell: ReadCell, namespace: Mapping[str, object] | None) -> set[int] | None:
        """The ids of the parameters and optimizers the cell reads, so what does not grow with the batch counts
        only what it trains; ``None`` where the cell does not parse."""
        if cell.parsed is None:
            return None
        state = training_state(namespace or {}, cell.reads, cell.binds_first)
        return {id(p) for p in state.parameters} | {id(o) for o in state.optimizers}

    def _put_back(self) -> None:
        if self.before_rerun is not None:
            self.before_rerun()

    # -- the whole fix ------------------------------------------------------------------------------
    def fix(
        self,
        cell: ReadCell,
        error: BaseException | None,
        namespace: Mapping[str, object] | None = None,
        freed_bytes: int | None = None,
        oom: OomInfo | None = None,
        allocated_before: int | None = None,
        history: Sequence[str] | None = None,
        cell_number: int | None = None,
        cleaned: CleanupResult | None = None,
    ) -> Outcome:
        """Try the strategies on ``cell``, which failed with ``error`` (parsed once into ``oom``; both
        ``None``: not run yet, ``%%oomfix``) after the cleanup ``cleaned`` freed ``freed_bytes``.
        ``allocated_before`` bounds what the cell needs; ``history`` and ``cell_number`` find the batch
        in the earlier cells that set it."""
        oom = self._start(error, oom, namespace, history)
        error = None  # the figures are all we keep
        failed = self._failed_cell(cell, namespace, oom, cell_number, freed_bytes, allocated_before, cleaned)
        fitted, strategy, batch = self._try_strategies(failed)
        self._closing_notes(fitted, batch.replayed_source is not None)
        return self._outcome(failed, fitted, strategy, batch, freed_bytes)

    def _start(self, error: BaseException | None, oom: OomInfo | None, namespace: Mapping[str, object] | None,
               history: Sequence[str] | None) -> OomInfo | None:
        """Hand the tries the namespace, and read the failure's figures (refusing any failure but an OOM)."""
        self._runs.namespace = namespace
        self._history = history
        if isinstance(namespace, MutableMapping):
            self._runs.aside = SetAside(namespace)
        if oom is None and error is not None:
            oom = parse_oom(error)
        if error is not None and oom is None:
            raise CudaMemError(f"the last failure was not a GPU out-of-memory error ({one_line(error)}); %oomfix does nothing for it")
        return oom

    def _failed_cell(self, cell: ReadCell, namespace: Mapping[str, object] | None, oom: OomInfo | None,
                     cell_number: int | None, freed_bytes: int | None, allocated_before: int | None,
                     cleaned: CleanupResult | None) -> _FailedCell:
        """Where the cell's batch lives and what its step holds whatever its batch (read before what the cell
        builds again is set aside: on the host, it counts nothing); then what it needs, its room and the
        reference level."""
        self._runs.rebinds = cell.rebinds
        finding = None
        if Strategy.BATCH in self.strategies:
            finding = find_batch(cell, namespace, history=list(self._history or []), cell_number=cell_number)
        self._fixed = fixed_memory(namespace or {}, cell.rebinds,
                                   self.probe if self.probe is not None else default_probe(), cell.traits.trains,
                                   read=self._trained_ids(cell, namespace))
        device = oom_device(oom)
        aside = self._runs.set_aside(device)
        if allocated_before is None and freed_bytes is not None:
            # Unknown: an upper bound, so the need it gives errs low.
            now = self._runs.allocated(device)
            if now is not None:
                allocated_before = now + freed_bytes + aside.freed_bytes
        budget = headroom_bytes(self.hardware, device)
        # Every try's figures are taken from this level: a try that fits leaves state later tries start with.
        self._runs.reference = self._runs.allocated(device)
        return _FailedCell(cell, namespace, oom, device, finding, needed_bytes(oom, allocated_before), budget, cleaned)

    def _try_strategies(self, cell: _FailedCell) -> tuple[TryResult | None, Strategy | None, BatchTried]:
        """The strategies in order until one fits or the tries run out."""
        fitted: TryResult | None = None
        strategy: Strategy | None = None
        batch = BatchTried()
        for name in self.strategies:
            if fitted is not None or self._runs.left() <= 0:
                break
            if name is Strategy.CLEANUP:
                fitted = self._cleanup_alone(cell)
            elif name is Strategy.BATCH and cell.finding is not None:
                batch = self._smaller_batch(cell, cell.finding)
                fitted = batch.fitted
            elif name is Strategy.AUTOCAST:
                fitted = self._autocast(cell)
            if fitted is not None:
                strategy = name
        return fitted, strategy, batch

    def _closing_notes(self, fitted: TryResult | None, not_rerun: bool = False) -> None:
        """Give back what was set aside, and say what the variables hold after the tries (``not_rerun``: the
        batch reported is the replay's, which no try ran)."""
        notes, tries, aside = self._runs.notes, self._runs.tries, self._runs.aside
        given = aside.give_back()
        if aside.left_on_host:
            notes.append(f"{', '.join(aside.left_on_host)} stayed on the host: moving them back to the GPU "
                         "ran out of memory (their data is whole; move them back once there is room)")
        if given and fitted is None:
            notes.append(f"nothing fitted: {', '.join(given)} bound again as the failed cell left them")
        if fitted is None and self._runs.stopped is None and self._runs.left() <= 0 and len(self.strategies) > 1:
            notes.append(f"stopped after --max-tries {self.max_tries} reruns")
        if not_rerun:
            notes.append(f"what the cell trains and changes is as before the reruns, the names it binds hold what rerun "
                         f"#{tries[-1].number} left; run the fixed cell to get its results")
        if tries and not tries[-1].fitted and fitted is not None:
            left = ("what the cell trains and changes is as before the reruns, the names it binds hold what the "
                    "failed rerun left" if self.before_rerun is not None else
                    "the variables hold what the failed rerun left")
            notes.append(f"the last rerun (#{tries[-1].number}) failed after #{fitted.number} fitted: {left}; "
                         "run the fixed cell again to get its results")

    def _outcome(self, cell: _FailedCell, fitted: TryResult | None, strategy: Strategy | None, batch: BatchTried,
                 freed_bytes: int | None) -> Outcome:
        autocast_dtype = self._dtype() if Strategy.AUTOCAST in self.strategies else None
        finding = cell.finding
        fragmented = bool(cell.oom is not None and cell.oom.looks_fragmented)
        suggestions = build_suggestions(
            cell.read.source, cell.read.traits, batch.batch_before, batch.batch_after, autocast_dtype, fragmented,
            strategy is Strategy.AUTOCAST,
            batch_home=None if finding is None or finding.chosen is None else finding.chosen.kind,
        )
        by_batch = strategy is Strategy.BATCH
        return Outcome(
            original_source=cell.read.source,
            fixed_source=None if fitted is None else batch.replayed_source if by_batch and batch.replayed_source else fitted.source,
            strategy=strategy,
            tries=tuple(self._runs.tries),
            batch_before=batch.batch_before,
            batch_after=batch.batch_after,
            batch_summary=finding.summary() if finding is not None and Strategy.BATCH in self.strategies else "",
            budget_bytes=cell.budget,
            freed_bytes=freed_bytes,
            suggestions=suggestions,
            notes=tuple(self._runs.notes),
            cell_diffs=batch.cell_diffs if by_batch else (),
            paste_code=batch.paste if by_batch else None,
        )

    # -- strategies ---------------------------------------------------------------------------------
    def _cleanup_alone(self, cell: _FailedCell) -> TryResult | None:
        """The cell as it is, once, where the cleanup freed at least what the failed allocation lacked of
        memory held before the cell: what it freed of the cell's own, a rerun makes again."""
        source, oom, needed, budget, device = cell.read.source, cell.oom, cell.need, cell.budget, cell.device
        if oom is None:  # the cell has not failed yet (``%%oomfix``)
            return self._fitted(Strategy.CLEANUP, source, "as written", device)
        # Of all the cleanup freed (the outcome's figure), what the rerun does not make again.
        gained, held_by = freed_from_before(cell.read.rebinds, cell.cleaned)
        what = f"of what the cleanup freed, {format_bytes(gained)} was held before the cell ({', '.join(held_by)})"
        lacked = lacked_bytes(oom)
        if needed is not None and budget is not None and needed > budget:
            skip = (f"the cell needs at least {format_bytes(needed)} (what it held when it failed plus the allocation "
                    f"that failed), {format_bytes(budget)} is free")
        elif not gained:
            skip = ("the cleanup freed only what the failed cell had made, which a rerun makes again, and it would "
                    "fail the same way")
        elif lacked is not None and gained < lacked:
            skip = f"{what}, less than the {format_bytes(lacked)} the allocation that failed lacked"
        else:
            lacking = "" if lacked is None else f"; the allocation that failed lacked {format_bytes(lacked)}"
            return self._fitted(Strategy.CLEANUP, source, f"{what}{lacking}", device)
        self._runs.notes.append(f"skipped a plain rerun: {skip}")
        return None

    def _fitted(self, strategy: Strategy, source: str, reason: str, device: int) -> TryResult | None:
        """One try; the try if it fitted."""
        result = self._runs.run(strategy, source, reason, device)
        return result if result.fitted else None

    def _smaller_batch(self, cell: _FailedCell, finding: BatchFinding) -> BatchTried:
        """The batch strategy; where the batch is the data, over chunks of all of it, or a refusal."""
        whole = whole_data_decision(finding, cell.namespace, cell.read.transform)
        if whole is not None:
            self._runs.notes.append(whole.note)
            if whole.chunked is None:
                return BatchTried()
        chosen = whole.chunked if whole is not None and whole.chunked is not None else finding
        stuck = None if cell.oom is None else cell.oom.reserved_unallocated_bytes
        strategy = SmallerBatch(self._runs, self.hardware, self.margin, self._fixed, list(self._history or []),
                                self._put_back if self.before_rerun is not None else None)
        tried = strategy.run(chosen, cell.budget, cell.need, cell.device, stuck, None if whole is None else whole.on_host)
        if chosen is finding:
            return tried
        # The chunked cell's diff starts from the cell as the user wrote it.
        diffs = tuple(replace(d, before=cell.read.source) if d.cell_number is None else d for d in tried.cell_diffs)
        return replace(tried, cell_diffs=diffs)

    def _autocast(self, cell: _FailedCell) -> TryResult | None:
        if cell.read.traits.autocast:
            self._runs.notes.append("the cell already uses autocast")
            return None
        namespace = cell.namespace
        has_torch = namespace is not None and getattr(namespace.get("torch"), "autocast", None) is not None
        dtype = self._dtype()
        try:
            wrapped = wrap_in_autocast(cell.read.source, dtype, import_torch=not has_torch,
                                       transform=cell.read.transform, outside_names=stepping_functions(namespace))
        except SyntaxError as error:
            self._runs.notes.append(f"could not wrap the cell in autocast: it does not parse ({error.msg})")
            return None
        except AutocastNotApplicable as reason:
            self._runs.notes.append(f"autocast not tried: {reason}")
            return None
        return self._fitted(Strategy.AUTOCAST, wrapped, f"torch.autocast('cuda', dtype=torch.{dtype})", cell.device)

    def _dtype(self) -> str:
        if self.autocast_dtype is not None:
            return self.autocast_dtype()
        from ..sources.torch_device import default_autocast_dtype

        return default_autocast_dtype()
