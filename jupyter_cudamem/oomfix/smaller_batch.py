"""``%oomfix``'s batch strategy: the batch search's tries, each made by the fix's ``FixTries``, with the
batch changed where it lives (``batch.BatchChange``) and put back, or kept at the largest that fitted.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field

from ..batch import BatchChange, BatchFinding, Knob
from ..cell.edit import CellDiff
from ..errors import CudaMemError
from ..growth import FixedMemory
from ..hardware import Hardware, reserved_limit_bytes
from ..batchsearch import BatchSearch, Observation
from ..units import format_bytes
from .outcome import TryResult
from .strategies import Strategy
from .tries import FixTries
from .whole_data import kept_on_host_note


@dataclass(frozen=True)
class BatchTried:
    """What the batch strategy did: the largest batch's try that fitted (``None``: none did), the batch the
    cell had, and where one fitted, the changed cells as diffs and the code to paste."""

    fitted: TryResult | None = None
    batch_before: int | None = None
    cell_diffs: tuple[CellDiff, ...] = ()
    paste: str | None = None
    # The batch reported and its cell, where no try ran it: the replay of the fitted try's own run says it keeps
    # fitting where the try's batch does not (``Tries.answer``).
    replayed_batch: int | None = None
    replayed_source: str | None = None

    @property
    def batch_after(self) -> int | None:
        if self.replayed_batch is not None:
            return self.replayed_batch
        return None if self.fitted is None else self.fitted.batch


@dataclass
class SmallerBatch:
    """One run of the batch strategy over ``runs``. ``fixed``: what the step holds whatever its batch;
    ``put_back``: puts the trained model and optimizer back before a try (``None``: nothing to put back)."""

    runs: FixTries
    hardware: Hardware
    margin: float
    fixed: FixedMemory | None
    history: list[str]
    put_back: Callable[[], None] | None = None
    # The number of tries when the model and optimizer were last put back (-1: not yet).
    _put_back_after: int = field(default=-1, init=False)
    # Where the batch lives for this run; a chunked cell whose result cannot move back switches to the
    # finding that leaves it on the host (``_search``).
    change: BatchChange = field(init=False)

    def run(self, finding: BatchFinding, budget: int | None, need: int | None, device: int, stuck: int | None = None,
            on_host: BatchFinding | None = None) -> BatchTried:
        """``need``: what the cell needs at least (bytes), ``stuck``: what the OOM left reserved and unallocated;
        ``on_host``: the chunked cell with its result left on the host, for when moving the joined result back
        runs out of memory (``whole_data.Join``)."""
        knob = finding.chosen
        if knob is None or knob.value < 2:
            self.runs.notes.append(finding.summary() if knob is None
                                   else f"the batch size is already {knob.value}; it cannot shrink")
            return BatchTried(batch_before=None if knob is None else knob.value)
        if budget is None:
            self.runs.notes.append("the free memory could not be read, so the batch search has no budget")
            return BatchTried(batch_before=knob.value)
        namespace = self.runs.namespace
        self.change = BatchChange(finding, knob, namespace if isinstance(namespace, MutableMapping) else {},
                                  self.history)
        search = BatchSearch(knob.value, budget, max_tries=self.runs.left(), margin=self.margin, need_bytes=need,
                             stuck_bytes=stuck, fixed=self.fixed)
        self._note_fixed()
        best, host_chunk = self._search(search, device, on_host)
        change = self.change
        if (best is None or best.batch is None) and host_chunk is not None and self.runs.left() > 0:
            # Only the try whose result could not move back fitted its chunks: run them on the host.
            result = self.runs.run(Strategy.BATCH, change.apply(host_chunk),
                                   "the chunks that fitted, result on the host", device, batch=host_chunk)
            best = result if result.fitted else None
        if best is None or best.batch is None:
            change.restore()
            return BatchTried(batch_before=change.knob.value)
        found = best.batch
        answer = search.answer or found
        if answer >= found:
            settled = self._settle(best, found, device, search)
            if settled is not best:
                # The rerun that confirms the batch is a run like the tries: its next runs start where it ends.
                search.record(found, settled.observation())
                answer = search.answer or found
            best = settled
        replayed = None  # the batch reported where no try ran it
        if answer < found:
            best, found = self._below_the_last_fit(best, found, answer, device, search)
            replayed = found if found != best.batch else None
        if replayed is None and found == answer:  # else the replay says it does not keep fitting: no proof to claim
            self.runs.notes.append(steady_note(best))
        change.forget_originals()
        return BatchTried(best, change.knob.value, change.diffs(found), change.paste_code(found),
                          replayed_batch=replayed, replayed_source=None if replayed is None else change.apply(found))

    def _note_fixed(self) -> None:
        """Say what the search counts as not growing with the batch, where it read any."""
        fixed = self.fixed
        if fixed is None or not fixed.total_bytes:
            return
        parts = [f"{format_bytes(size)} {what}" for size, what in (
            (fixed.parameters_bytes, "of parameters the cell builds"),
            (fixed.gradients_bytes, "of gradients its backward pass makes"),
            (fixed.optimizer_state_bytes, "of optimizer state its first step makes")) if size]
        self.runs.notes.append(f"does not grow with the batch: {', '.join(parts)} (read from the namespace)")

    def _search(self, search: BatchSearch, device: int, on_host: BatchFinding | None
                ) -> tuple[TryResult | None, int | None]:
        """The search's tries: the largest batch that fitted, and the chunk whose work fitted before moving
        its result back ran out of memory (``None``: none did)."""
        best: TryResult | None = None
        host_chunk: int | None = None
        while self.runs.left() > 0:
            self._before_try(search, device)
            if (batch := search.next()) is None:
                break
            try:
                source = self.change.apply(batch)
            except CudaMemError as problem:
                self.runs.stop(f"could not set the batch: {problem}")
                break
            result = self.runs.run(Strategy.BATCH, source, search.reason, device, batch=batch)
            observation = result.observation()
            if on_host is not None and moved_back_ran_out(result, self.change.knob):
                # No chunk size makes the joined result fit: go on with it left on the host; the chunks' work fitted.
                self.change.restore()
                self.change = BatchChange(on_host, on_host.chosen or self.change.knob, self.change.namespace,
                                          self.history)
                self.runs.notes.append(kept_on_host_note(self.change.knob.value, batch))
                on_host = None
                host_chunk = batch
                recorded = None if result.recorded is None else result.recorded.without_the_request_that_raised()
                observation = Observation(True, peak_bytes=observation.held_bytes, start_bytes=observation.start_bytes,
                                          recorded=recorded)
            search.record(batch, observation)
            if result.fitted and (best is None or batch > (best.batch or 0)):
                best = result
            if self.runs.stopped is not None:
                search.stop(self.runs.stopped)
        if self.runs.tries and not self.runs.tries[-1].fitted:
            self.runs.release_graph_pools(device)
        if search.stopped is not None and self.runs.stopped is None and self.runs.left() > 0:
            self.runs.notes.append(f"the batch search ended: {search.stopped}")  # why fewer reruns than allowed
        return best, host_chunk

    def _before_try(self, search: BatchSearch, device: int) -> None:
        """Start the next try as the user's next run of the cell will, and tell the search what it starts from."""
        if self.runs.tries:
            # Values put back, while what the last run made and bound stays allocated, as in the next run.
            self.runs.set_aside(device)
            self._put_back_now()
        self.runs.release_graph_pools(device)
        # cuBLAS's workspaces made again in segments of their own: carved from a large cached block, they pin
        # its segment and every later try starts from its fragments.
        self.hardware.allocator.renew_workspaces(device)
        level = self.runs.allocated(device)
        if level is not None and self.runs.reference is not None:
            search.set_level(level - self.runs.reference)
        self._tell_allocator(search, device)

    def _tell_allocator(self, search: BatchSearch, device: int) -> None:
        """Where the next run starts: the allocator's segments, its cap, what in them the cell binds again
        and what the put-back holds until the first step."""
        search.set_allocator(self.runs.recorder.state(device), reserved_limit_bytes(self.hardware, device),
                             self.runs.rebound_addresses(), self.runs.released_addresses())

    def _settle(self, best: TryResult, found: int, device: int, search: BatchSearch) -> TryResult:
        """Set the knob to the best batch (``found``, ``best``'s), and rerun it where the variables and the
        model do not hold its run (``search`` told where that rerun starts)."""
        last_fitted = next((t for t in reversed(self.runs.tries) if t.fitted), None)
        if not self.runs.tries[-1].fitted:
            # Put back before the knob is set to the best batch: after, the knob would go back too.
            self._put_back_now()
        source = self.change.apply(found)  # the knob holds the best batch whether or not it is rerun
        put_back_since = self._put_back_after == len(self.runs.tries)
        if (last_fitted is not best or not self.runs.tries[-1].fitted or put_back_since) and self.runs.left() > 0:
            # The variables and the model must hold the run the outcome reports.
            self._tell_allocator(search, device)
            rerun = self.runs.run(Strategy.BATCH, source, "rerun of the largest batch that fitted", device, batch=found)
            if rerun.fitted:
                return rerun
        return best

    def _below_the_last_fit(self, best: TryResult, found: int, answer: int, device: int,
                            search: BatchSearch) -> tuple[TryResult, int]:
        """``best`` fitted, but its own run, replayed as the next runs make it, does not keep fitting and
        ``answer`` does: rerun at ``answer`` where a rerun is left (it holds what ``best``'s run left, as the
        next run will), itself judged so (``Tries.kept``); else ``answer`` is reported as the replay's. The
        try that proves the batch, and the batch."""
        self.runs.notes.append(_not_kept_note(best, found, answer))
        if self.runs.left() > 0:
            self._tell_allocator(search, device)
            confirm = self.runs.run(Strategy.BATCH, self.change.apply(answer), f"{answer}, which the replay of rerun "
                                    f"#{best.number}'s own run keeps fitting", device, batch=answer)
            if confirm.fitted:
                search.record(answer, confirm.observation())
                lower = search.kept(answer)
                if not 0 < lower < answer:
                    return confirm, answer
                # Its own run, from where it began (where the larger try's run left the allocator), does not
                # keep fitting either: the next runs begin where it ends.
                self.runs.notes.append(_not_kept_note(confirm, answer, lower))
                self._put_back_now()
                return confirm, lower
            self._put_back_now()
            self.change.apply(found)
            return best, found
        return best, answer

    def _put_back_now(self) -> None:
        """Put the trained model and optimizer back (where there is a ``put_back``), noting after which try."""
        if self.put_back is not None:
            self.put_back()
            self._put_back_after = len(self.runs.tries)


def _not_kept_note(fitted: TryResult, batch: int, lower: int) -> str:
    return (f"rerun #{fitted.number} at {batch} fitted once, but its own requests, replayed run after run as your "
            f"next runs make them, run out of memory: {lower} keeps fitting in that replay")


def steady_note(best: TryResult) -> str:
    """Whether the run the fix reports is the proof that the cell's next runs fit (see ``FixTries``)."""
    if best.steady:
        return (f"rerun #{best.number} at {best.batch} ran as your next runs will, holding what the run before "
                "it leaves (optimizer state, gradients, the values the cell binds again): it keeps fitting")
    return (f"rerun #{best.number} at {best.batch} was the first to fit: it did not hold what a run leaves "
            "(a first step's optimizer state, gradients); run the cell twice to check it keeps fitting")


def moved_back_ran_out(result: TryResult, knob: Knob) -> bool:
    """Whether a try of chunks joined through the host ran out of memory moving the joined result back: on a
    line the chunk size is written on, outside any model's forward pass (where the chunks' own work runs)."""
    site = result.failed_at
    lines = {written.span.line for written in knob.written if written.cell is None}
    return result.out_of_memory and site is not None and not site.in_module and site.line in lines
