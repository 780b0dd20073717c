"""Rerun a cell that ran out of GPU memory until a form of it fits, measuring every try.

The driver knows nothing of IPython: it is handed a function that runs a cell's source and returns
the exception it raised (``None`` when it ran), a function that frees what a failure left behind,
and the ``Hardware`` to measure with. The magic passes the shell's ``run_cell`` and the real cleanup;
tests pass a simulated cell and fake hardware (``tests/oomfix/simulated.py``).

Tries stop at ``max_tries``, at the first try that fits (for a batch search: once the search says a
larger batch will not fit), and at any error that is not an OOM: that one is the user's to see.

The batch is changed where it lives (``batch.BatchChange``: the cell's text, a variable or config of an
earlier cell, a DataLoader, a Trainer's arguments), found once per fix and kept at the best batch that
fitted, or put back when none did. Every try starts with what the failed cell started with: what the
failed cell bound and binds again is set aside first (``reruns.set_aside``), and each failed try is undone.
The OOM of each try is parsed once, and only its figures are kept (``TryResult``), never the exception;
each source (the failed cell's, each try's) is parsed once per fix, and every reader gets that tree.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..errors import CudaMemError
from ..hardware import Hardware, headroom_bytes, reserved_limit_bytes
from ..measure import Meter
from ..units import format_bytes
from ..advice import build_suggestions
from ..attribution.probe import TensorProbe, default_probe
from ..attribution.training_state import fixed_memory
from ..growth import FixedMemory
from ..batch import BatchChange, BatchFinding, Knob, find_batch
from ..cell.edit import AutocastNotApplicable, CellDiff, wrap_in_autocast
from ..cell.source import ParsedCell, default_transform, parse_cell
from ..cell.traits import cell_traits
from .cleanup import CleanupResult
from ..reruns.set_aside import Mover, SetAside, names_bound_before_read, restore_bindings, set_aside
from ..sources.torch_host import TorchMover
from .options import check_max_tries, check_strategies
from .outcome import Outcome, TryResult
from ..oom import OomInfo, parse_oom
from ..reruns.recording import Recorder
from ..reruns.search import BatchSearch
from .strategies import STRATEGIES, Strategy
from .whole_data import whole_data_decision

RunSource = Callable[[str], "BaseException | None"]
Cleanup = Callable[["BaseException | None"], Any]


def _lacked_bytes(oom: OomInfo) -> int | None:
    """How much more room the allocation that failed needed than the process had then: the request less
    what was free for it (under a per-process cap, the cap less what the process held; never more than
    the device had free). ``None`` where the message does not say."""
    if oom.requested_bytes is None:
        return None
    free = []
    if oom.allowed_bytes is not None and oom.process_bytes is not None:
        free.append(oom.allowed_bytes - oom.process_bytes)
    if oom.free_bytes is not None:
        free.append(oom.free_bytes)
    if not free:
        return None
    return max(oom.requested_bytes - max(min(free), 0), 0)


def needed_bytes(oom: OomInfo | None, allocated_before: int | None) -> int | None:
    """A lower bound of what the failed cell needs above what it started with: what it had allocated
    when it failed (less what was allocated when it started), plus the allocation that failed."""
    if oom is None or allocated_before is None or oom.allocated_bytes is None or oom.requested_bytes is None:
        return None
    return max(oom.allocated_bytes - allocated_before, 0) + oom.requested_bytes


def undo_bindings(namespace: MutableMapping[str, Any], before: Mapping[str, Any]) -> list[str]:
    """``set_aside.restore_bindings``: put the namespace back as it was before a failed try."""
    return restore_bindings(namespace, before)


def stepping_functions(namespace: Mapping[str, Any] | None) -> frozenset[str]:
    """Functions of earlier cells whose code calls ``backward``, ``step`` or ``zero_grad``: a call of one
    stays outside autocast (``wrap_in_autocast``'s ``outside_names``)."""
    import types

    return frozenset(
        name for name, value in (namespace or {}).items()
        if isinstance(value, types.FunctionType) and {"backward", "step", "zero_grad"} & set(value.__code__.co_names)
    )


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    first = text[0] if text else ""
    if len(first) > 160:
        first = first[:159] + "…"
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


@dataclass
class Driver:
    """Runs the strategies in order for one failed cell; see the module docstring.

    ``mover`` moves what the failed cell bound to the host before the reruns (``reruns.set_aside``);
    ``None`` uses PyTorch's (``set_aside.TorchMover``), tests pass fakes. ``oom_of`` reads a try's OOM
    from its exception (``oom.parse_oom`` when ``None``): a caller that has parsed it already (the
    magic, to hide a try's OOM traceback) hands that over, so each try's OOM is parsed once.
    """

    run_source: RunSource
    hardware: Hardware
    cleanup: Cleanup
    max_tries: int = 3
    strategies: tuple[Strategy, ...] = STRATEGIES
    autocast_dtype: Callable[[], str] | None = None
    transform: Callable[[str], str] | None = None
    margin: float = 0.04
    mover: Mover | None = None
    oom_of: Callable[[BaseException], OomInfo | None] | None = None
    probe: TensorProbe | None = None
    # Called at the start of each rerun (``reruns.model_state.Restorer.restore``: the model and optimizer
    # the cell trains put back as they were); it must do nothing when nothing ran since. Not before the
    # search reads the level of the next try: a search that then proposes nothing would leave the state
    # put back instead of the last fitted try's; the level it reads includes what a fitted try left (as
    # without restoring), so it errs low.
    before_rerun: Callable[[], object] | None = None

    def __post_init__(self) -> None:
        self.max_tries = check_max_tries(self.max_tries)
        self.strategies = check_strategies(self.strategies)
        self._tries: list[TryResult] = []
        self._notes: list[str] = []
        self._namespace: Mapping[str, Any] | None = None
        self._history: Sequence[str] | None = None
        self._stopped: str | None = None  # why no more tries are made (never an overwrite of max_tries)
        self._aside = SetAside({})  # what is on the host until a try that fits binds it anew
        self._kept_noted: set[str] = set()
        self._transform: Callable[[str], str] | None = self.transform
        self._reference: int | None = None  # allocated bytes every try's figures are taken from
        self._cells: dict[str, ParsedCell | None] = {}  # every source of this fix, parsed once (``_parsed``)
        self._recorder = Recorder(self.hardware.allocator)
        self._fixed: FixedMemory | None = None  # what the cell's step holds whatever its batch

    # -- one measured try -------------------------------------------------------------------------
    def _allocated(self, device: int) -> int | None:
        readings = self.hardware.allocator_readings()
        reading = readings.get(device) if readings else None
        return None if reading is None else reading.allocated_bytes

    def _try(self, strategy: Strategy, source: str, reason: str, device: int, batch: int | None = None) -> TryResult:
        self._before_rerun()
        namespace = self._namespace if isinstance(self._namespace, MutableMapping) else None
        # What the last state bound and this try binds again (the failed cell's input, or a fitted
        # try's) goes to the host first, so the try starts where the failed cell started.
        self._set_aside(source, device)
        before = dict(namespace) if namespace is not None else None
        meter = Meter(self.hardware, devices=[device])
        baseline = meter.start()
        at_start = self._allocated(device)
        # A batch try's allocations are recorded for the search's replay of the allocator (``replay``).
        recording = self._recorder.start(device) if batch is not None else None
        started = time.perf_counter()
        try:
            error = self.run_source(source)
        except BaseException:
            self._recorder.stop(recording, device, failed=True)  # an interrupt must not leave it recording
            raise
        wall_s = time.perf_counter() - started
        recorded = self._recorder.stop(recording, device, failed=error is not None)
        measurement = meter.stop(baseline, error=None if error is None else type(error).__name__)
        if error is not None and namespace is not None and before is not None:
            # A failed try leaves nothing behind: the variables are as the last try that fitted left them.
            undo_bindings(namespace, before)
        before = None
        peak = next((d.peak_above_start_bytes for d in measurement.devices), None)
        # Parsed once (here or by ``oom_of``'s owner); only its figures are kept.
        oom = None if error is None else (self.oom_of or parse_oom)(error)
        message = None if error is None or oom is not None else _one_line(error)
        # Free what this try left (a failed try holds its frames like the original failure did), then
        # let go of the exception: nothing of ours may keep its traceback.
        self.cleanup(error)
        error = None
        if message is None and oom is None:
            self._aside.drop_rebound()  # the try bound its own values: what was set aside is superseded
        left = self._allocated(device)
        # Above the fix's reference level (see ``fix``): what the try started with counts as its own.
        offset = 0 if at_start is None or self._reference is None else at_start - self._reference
        need = needed_bytes(oom, at_start)
        result = TryResult(
            number=len(self._tries) + 1,
            strategy=strategy,
            source=source,
            fitted=message is None and oom is None,
            out_of_memory=oom is not None,
            peak_bytes=peak,
            wall_s=wall_s,
            reason=reason,
            batch=batch,
            error=message,
            allocated_at_start_bytes=at_start,
            need_bytes=need,
            left_bytes=None if left is None or at_start is None else left - at_start,
            start_above_reference_bytes=offset,
            stuck_bytes=None if oom is None else oom.reserved_unallocated_bytes,
            recorded=recorded,
        )
        self._tries.append(result)
        if message is not None:
            # A changed cell that fails otherwise (a shape that needed the old batch...) is not ours
            # to keep retrying; spend no more tries.
            self._stop(f"rerun #{result.number} failed with {message}; stopped")
        return result

    def _before_rerun(self) -> None:
        if self.before_rerun is not None:
            self.before_rerun()

    def _left(self) -> int:
        return 0 if self._stopped is not None else self.max_tries - len(self._tries)

    def _stop(self, reason: str) -> None:
        if self._stopped is None:
            self._stopped = reason
            self._notes.append(reason)

    # -- the whole fix ------------------------------------------------------------------------------
    def fix(
        self,
        source: str,
        error: BaseException | None,
        namespace: Mapping[str, Any] | None = None,
        freed_bytes: int | None = None,
        diagnosis: object | None = None,
        oom: OomInfo | None = None,
        allocated_before: int | None = None,
        history: Sequence[str] | None = None,
        cell_number: int | None = None,
        finding: BatchFinding | None = None,
        cleaned: CleanupResult | None = None,
    ) -> Outcome:
        """Try the strategies on ``source``, which failed with ``error``; cleanup has already run.

        ``oom`` is the failure as parsed (pass it when the exception itself was released by the
        cleanup; it is parsed from ``error`` otherwise, once); ``error`` and ``oom`` both ``None`` means
        the cell has not run yet (``%%oomfix``). ``allocated_before`` is what PyTorch had allocated
        when the failed cell started: with the OOM's figures it bounds what the cell needs, which
        decides whether a plain rerun can fit and where the batch search starts. ``history`` is
        IPython's input history (``In``) and ``cell_number`` the failed cell's ``k``, so the batch is
        found in the earlier cells that set it; ``finding`` a finding already made for this cell;
        ``cleaned`` the cleanup's result, whose figures say what it freed that was held before the cell.
        """
        self._namespace = namespace
        self._history = history
        if isinstance(namespace, MutableMapping):
            self._aside = SetAside(namespace)
        if oom is None and error is not None:
            oom = parse_oom(error)
        if error is not None and oom is None:
            raise CudaMemError(f"the last failure was not a GPU out-of-memory error ({_one_line(error)}); %oomfix does nothing for it")
        error = None  # the figures are all we keep
        device = oom.device_index if oom is not None and oom.device_index is not None else 0
        transform = self._transform = self.transform or default_transform
        if finding is None and Strategy.BATCH in self.strategies:
            finding = find_batch(source, namespace, transform, history=list(history or []), cell_number=cell_number,
                                 parsed=self._parsed(source))
        traits = cell_traits(source, transform, self._parsed(source))
        # Read before the models the cell builds again are set aside (on the host, they count nothing).
        self._fixed = fixed_memory(namespace or {}, self._bound_again(source),
                                   self.probe if self.probe is not None else default_probe(), traits.trains)
        aside = self._set_aside(source, device)
        if allocated_before is None and freed_bytes is not None:
            # Unknown: at most what is allocated now plus what the cleanup and the set-aside freed
            # (both may include what was there before the cell), so the need it gives errs low.
            now = self._allocated(device)
            if now is not None:
                allocated_before = now + freed_bytes + aside.freed_bytes
        budget = headroom_bytes(self.hardware, device)
        # Every try's figures are taken from this level, not from the try's own start: a try that fits
        # leaves state the user keeps (gradients, an optimizer's first-step state, cuBLAS's workspace),
        # so later tries start higher, and a peak measured from a higher start would mix two scales.
        self._reference = self._allocated(device)
        need = needed_bytes(oom, allocated_before)
        fragmented = bool(oom is not None and oom.looks_fragmented)
        fitted: TryResult | None = None
        strategy: Strategy | None = None
        batch_before = batch_after = None
        cell_diffs: tuple[CellDiff, ...] = ()
        paste: str | None = None

        for name in self.strategies:
            if fitted is not None or self._left() <= 0:
                break
            if name is Strategy.CLEANUP:
                fitted = self._cleanup_alone(source, oom, need, budget, device, cleaned)
            elif name is Strategy.BATCH and finding is not None:
                # The batch is the data (inference over a whole tensor): chunks over all of it, or a refusal.
                whole = whole_data_decision(finding, namespace, transform, self._parsed(finding.source))
                if whole is not None:
                    self._notes.append(whole.note)
                if whole is None or whole.chunked is not None:
                    chosen = whole.chunked if whole is not None and whole.chunked is not None else finding
                    stuck = None if oom is None else oom.reserved_unallocated_bytes
                    fitted, batch_before, cell_diffs, paste = self._smaller_batch(chosen, budget, need, device, stuck)
                    batch_after = None if fitted is None else fitted.batch
                    if chosen is not finding:
                        # The chunked cell's diff starts from the cell as the user wrote it.
                        cell_diffs = tuple(
                            replace(d, before=source) if d.cell_number is None else d for d in cell_diffs
                        )
            elif name is Strategy.AUTOCAST:
                has_torch = namespace is not None and getattr(namespace.get("torch"), "autocast", None) is not None
                fitted = self._autocast(source, traits, device, import_torch=not has_torch)
            if fitted is not None:
                strategy = name
        # Set aside and not bound again by a try that fitted since: give it back, so the variables hold
        # what the last try that fitted left (or, when none did, what the failed cell left).
        given = self._aside.give_back()
        if self._aside.left_on_host:
            self._notes.append(f"{', '.join(self._aside.left_on_host)} stayed on the host: moving them back to the GPU "
                               "ran out of memory (their data is whole; move them back once there is room)")
        if given and fitted is None:
            self._notes.append(f"nothing fitted: {', '.join(given)} bound again as the failed cell left them")
        if fitted is None and self._stopped is None and self._left() <= 0 and len(self.strategies) > 1:
            self._notes.append(f"stopped after --max-tries {self.max_tries} reruns")
        if self._tries and not self._tries[-1].fitted and fitted is not None:
            self._notes.append(
                f"the last rerun (#{self._tries[-1].number}) failed after #{fitted.number} fitted: the variables "
                "hold what the failed rerun left; run the fixed cell again to get its results"
            )
        autocast_dtype = self._dtype() if Strategy.AUTOCAST in self.strategies else None
        suggestions = build_suggestions(
            source, traits, batch_before, batch_after, autocast_dtype, fragmented, strategy is Strategy.AUTOCAST,
            # Where the batch lives decides how to accumulate (a Trainer's gradient_accumulation_steps).
            batch_home=None if finding is None or finding.chosen is None else finding.chosen.kind,
        )
        return Outcome(
            original_source=source,
            fixed_source=None if fitted is None else fitted.source,
            strategy=strategy,
            tries=tuple(self._tries),
            batch_before=batch_before,
            batch_after=batch_after,
            batch_summary=finding.summary() if finding is not None and Strategy.BATCH in self.strategies else "",
            budget_bytes=budget,
            freed_bytes=freed_bytes,
            suggestions=suggestions,
            notes=tuple(self._notes),
            diagnosis=diagnosis,
            cell_diffs=cell_diffs if strategy is Strategy.BATCH else (),
            paste_code=paste if strategy is Strategy.BATCH else None,
        )

    def _set_aside(self, source: str, device: int) -> SetAside:
        """Set aside (``set_aside.set_aside``) what ``source`` binds again; kept with what earlier tries
        set aside until a try that fits supersedes it or the fix ends."""
        namespace = self._namespace
        if not isinstance(namespace, MutableMapping):
            return self._aside
        mover = self.mover if self.mover is not None else TorchMover()
        before = self._allocated(device)
        aside = set_aside(namespace, source, mover, names=self._bound_again(source))
        after = self._allocated(device)
        if before is not None and after is not None:
            aside.freed_bytes = max(before - after, 0)
        new = [name for name in aside.names if name not in self._aside.entries]
        if new and not self._tries:
            self._notes.append(
                f"set aside on the host before rerunning (the cell binds them again): {', '.join(new)}"
            )
        for name in aside.kept:
            if name not in self._kept_noted:
                self._kept_noted.add(name)
                self._notes.append(f"could not set aside {name}: its GPU memory stays held during the reruns")
        self._aside.merge(aside)
        return aside

    def _parsed(self, source: str) -> ParsedCell | None:
        """``source`` as IPython runs it (``parse_cell``), parsed once per fix; ``None`` when it does not
        parse (each reader then says so in its own words)."""
        if source not in self._cells:
            try:
                self._cells[source] = parse_cell(source, self._transform)
            except Exception:  # noqa: BLE001  SyntaxError, or IPython's transformer on odd input
                self._cells[source] = None
        return self._cells[source]

    def _bound_again(self, source: str) -> list[str]:
        """``set_aside.bound_before_read`` of ``source`` from its tree parsed once. A cell under a cell
        magic (``%%time``) runs as one call of it: it binds no name of its own."""
        parsed = self._parsed(source)
        return [] if parsed is None or parsed.header_lines else names_bound_before_read(parsed.tree)

    # -- strategies ---------------------------------------------------------------------------------
    def _cleanup_alone(self, source: str, oom: OomInfo | None, needed: int | None, budget: int | None,
                       device: int, cleaned: CleanupResult | None) -> TryResult | None:
        """The cell as it is, once, where the figures say it can fit after the cleanup.

        A rerun makes again everything the failed cell made, its fragments included (before raising an
        OOM, PyTorch's allocator has already released its unused cached blocks and retried): what the
        cleanup freed of the failed cell's own (its traceback's frames, the model it built) is no room a
        rerun has. Only what was held before the cell and is gone now is (the output cache of earlier
        cells, a variable deleted with ``--del`` that the cell does not bind), and the rerun gets past the
        allocation that failed only if that is at least what the allocation lacked then."""
        if oom is None:
            return self._plain("as written", source, device)  # the cell has not failed yet (``%%oomfix``)
        if needed is not None and budget is not None and needed > budget:
            self._notes.append(
                f"skipped a plain rerun: the cell needs at least {format_bytes(needed)} "
                f"(what it held when it failed plus the allocation that failed), {format_bytes(budget)} is free"
            )
            return None
        gained, held_by = self._freed_from_before(source, cleaned)
        lacked = _lacked_bytes(oom)
        if not gained:
            self._notes.append("skipped a plain rerun: the cleanup freed only what the failed cell had made, "
                               "which a rerun makes again, and it would fail the same way")
            return None
        what = f"{format_bytes(gained)} held before the cell ({', '.join(held_by)})"
        if lacked is not None and gained < lacked:
            self._notes.append(f"skipped a plain rerun: the cleanup freed {what}, less than the "
                               f"{format_bytes(lacked)} the allocation that failed lacked")
            return None
        lacking = "" if lacked is None else f"; the allocation that failed lacked {format_bytes(lacked)}"
        return self._plain(f"the cleanup freed {what}{lacking}", source, device)

    def _plain(self, reason: str, source: str, device: int) -> TryResult | None:
        result = self._try(Strategy.CLEANUP, source, reason, device)
        return result if result.fitted else None

    def _freed_from_before(self, source: str, cleaned: CleanupResult | None) -> tuple[int, list[str]]:
        """What the cleanup freed that was held before the failed cell: the output cache, and each
        variable deleted with ``--del`` that the cell does not bind (one it binds, it made)."""
        if cleaned is None:
            return 0, []
        rebound = set(self._bound_again(source))
        gained, held_by = 0, []
        if cleaned.freed_output_cache_bytes:
            gained += cleaned.freed_output_cache_bytes
            held_by.append("the output cache")
        for name, freed in cleaned.freed_by_name.items():
            if freed and name not in rebound:
                gained += freed
                held_by.append(name)
        return gained, held_by

    def _batch_knob(self, finding: BatchFinding) -> Knob | None:
        """The knob the batch strategy changes: the one place where it is chosen (a check that a knob
        must not be shrunk belongs here). ``None``, with a note saying why, when there is none."""
        knob = finding.chosen
        if knob is None:
            self._notes.append(finding.summary())
            return None
        if knob.value < 2:
            self._notes.append(f"the batch size is already {knob.value}; it cannot shrink")
            return None
        return knob

    def _smaller_batch(
        self, finding: BatchFinding, budget: int | None, need: int | None, device: int, stuck: int | None = None
    ) -> tuple[TryResult | None, int | None, tuple[CellDiff, ...], str | None]:
        knob = self._batch_knob(finding)
        if knob is None:
            return None, None if finding.chosen is None else finding.chosen.value, (), None
        if budget is None:
            self._notes.append("the free memory could not be read, so the batch search has no budget")
            return None, knob.value, (), None
        namespace = self._namespace if isinstance(self._namespace, MutableMapping) else {}
        change = BatchChange(finding, knob, namespace, list(self._history or []))
        search = BatchSearch(knob.value, budget, max_tries=self._left(), margin=self.margin, need_bytes=need,
                             stuck_bytes=stuck, fixed=self._fixed)
        if self._fixed is not None and self._fixed.total_bytes:
            fixed = self._fixed
            parts = [f"{format_bytes(size)} {what}" for size, what in (
                (fixed.parameters_bytes, "of parameters the cell builds"),
                (fixed.gradients_bytes, "of gradients its backward pass makes"),
                (fixed.optimizer_state_bytes, "of optimizer state its first step makes")) if size]
            self._notes.append(f"does not grow with the batch: {', '.join(parts)} (read from the namespace)")
        best: TryResult | None = None
        put_back_after = -1  # the number of tries when the model and optimizer were last put back
        while self._left() > 0:
            if self._tries:
                # What the last try bound goes to the host now (the names do not depend on the batch),
                # and the model and optimizer go back as they were before the reruns (``before_rerun``),
                # so the allocator's state and the level the search reads are where the next try starts:
                # read before, the last try's AdamW state would count as held through the next forward
                # pass (on an H100, a ViT-B/16 fine-tune put at 40 where 48 fits).
                self._set_aside(self._tries[-1].source, device)
                if self.before_rerun is not None:
                    self._before_rerun()
                    put_back_after = len(self._tries)
            level = self._allocated(device)
            if level is not None and self._reference is not None:
                search.set_level(level - self._reference)
            search.set_allocator(self._recorder.state(device), reserved_limit_bytes(self.hardware, device))
            if (batch := search.next()) is None:
                break
            try:
                source = change.apply(batch)
            except CudaMemError as problem:
                self._stop(f"could not set the batch: {problem}")
                break
            result = self._try(Strategy.BATCH, source, search.reason, device, batch=batch)
            search.record(batch, result.observation())
            if result.fitted and (best is None or batch > (best.batch or 0)):
                best = result
            if self._stopped is not None:
                search.stop(self._stopped)
        if search.stopped is not None and self._stopped is None and self._left() > 0:
            self._notes.append(f"the batch search ended: {search.stopped}")  # why fewer reruns than allowed
        if best is None or best.batch is None:
            change.restore()
            return None, knob.value, (), None
        found = best.batch
        last_fitted = next((t for t in reversed(self._tries) if t.fitted), None)
        source = change.apply(found)  # the knob holds the best batch whether or not it is rerun
        put_back_since = put_back_after == len(self._tries)
        if (last_fitted is not best or not self._tries[-1].fitted or put_back_since) and self._left() > 0:
            # Failed tries are undone, so the variables hold the last try that fitted; when that is
            # not the best, or a try failed after it, or the model's state was put back after it for
            # a try the search then did not choose, rerun the best so they and the model hold the run
            # the outcome reports.
            confirm = self._try(Strategy.BATCH, source, "rerun of the largest batch that fitted", device, batch=found)
            if confirm.fitted:
                best = confirm
        change.forget_originals()
        return best, knob.value, change.diffs(found), change.paste_code(found)

    def _autocast(self, source: str, traits: Any, device: int, import_torch: bool = True) -> TryResult | None:
        if traits.autocast:
            self._notes.append("the cell already uses autocast")
            return None
        dtype = self._dtype()
        try:
            wrapped = wrap_in_autocast(source, dtype, import_torch=import_torch, transform=self.transform,
                                       parsed=self._parsed(source), outside_names=stepping_functions(self._namespace))
        except SyntaxError as error:
            self._notes.append(f"could not wrap the cell in autocast: it does not parse ({error.msg})")
            return None
        except AutocastNotApplicable as reason:
            self._notes.append(f"autocast not tried: {reason}")
            return None
        result = self._try(Strategy.AUTOCAST, wrapped, f"torch.autocast('cuda', dtype=torch.{dtype})", device)
        return result if result.fitted else None

    def _dtype(self) -> str:
        if self.autocast_dtype is not None:
            return self.autocast_dtype()
        from .strategies import default_autocast_dtype

        return default_autocast_dtype()
