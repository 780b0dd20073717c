"""The measured tries of one ``%oomfix``: each rerun starts where the failed cell started (what it binds
again set aside on the host), runs measured (``reruns.measured``), is undone when it fails, and counts
against ``max_tries``; the notes the tries leave for the outcome.

Why apart from the driver: the driver decides what to try (the strategies, the batch search); this
knows how one try is made and read, and nothing of why it was chosen.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from ..batch.libraries import is_module
from ..hardware import Hardware
from ..measure import Meter
from ..oom import OomInfo, parse_oom
from ..reruns.graph_pools import GraphPools
from ..reruns.measured import run_measured
from ..reruns.recording import Recorder
from ..reruns.set_aside import Mover, SetAside, restore_bindings, set_aside
from ..sources.torch_host import TorchMover
from .outcome import FailureSite, TryResult
from .strategies import Strategy

RunSource = Callable[[str], "BaseException | None"]
Cleanup = Callable[["BaseException | None"], Any]


def lacked_bytes(oom: OomInfo) -> int | None:
    """How much more room the allocation that failed needed than the process had then: the request less
    what was free for it (under a per-process cap, the cap less what PyTorch had reserved
    (``OomInfo.room_under_cap_bytes``); never more than the device had free). ``None`` where the message
    does not say."""
    if oom.requested_bytes is None:
        return None
    free = []
    if oom.room_under_cap_bytes is not None:
        free.append(oom.room_under_cap_bytes)
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


def failure_site(error: BaseException) -> FailureSite | None:
    """Where in the cell ``error`` arose: the line of the cell's own code (the first ``<module>`` frame of
    its traceback: IPython's frames above it are functions) and whether a model's forward pass (a frame
    whose ``self`` is a module) lies below it. ``None`` when no frame of the cell is in the traceback."""
    cell = None
    in_module = False
    traceback = error.__traceback__
    while traceback is not None:
        frame = traceback.tb_frame
        if cell is None and frame.f_code.co_name == "<module>":
            cell = traceback.tb_lineno
        elif cell is not None and is_module(frame.f_locals.get("self")):
            in_module = True
        traceback = traceback.tb_next
    return None if cell is None else FailureSite(cell, in_module)


def one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    first = text[0] if text else ""
    if len(first) > 160:
        first = first[:159] + "…"
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


@dataclass
class FixTries:
    """The tries of one fix (see the module docstring). ``run_source`` runs a cell's source and returns
    its error; ``cleanup`` frees what a failed try left; ``before_rerun`` puts the trained model and
    optimizer back before each try (``Driver.before_rerun``); ``oom_of`` reads a try's OOM (``parse_oom``
    when ``None``); ``mover`` moves what is set aside (``TorchMover`` when ``None``). ``rebinds``: the
    names the failed cell binds again (``ReadCell.rebinds``), every try's too (a try changes its batch,
    not its names)."""

    run_source: RunSource
    hardware: Hardware
    cleanup: Cleanup
    max_tries: int
    mover: Mover | None = None
    oom_of: Callable[[BaseException], OomInfo | None] | None = None
    before_rerun: Callable[[], object] | None = None
    rebinds: tuple[str, ...] = ()
    tries: list[TryResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    namespace: Mapping[str, Any] | None = None
    stopped: str | None = None  # why no more tries are made (never an overwrite of max_tries)
    aside: SetAside = field(default_factory=lambda: SetAside({}))  # on the host until a try that fits binds it anew
    reference: int | None = None  # allocated bytes every try's figures are taken from

    def __post_init__(self) -> None:
        self._kept_noted: set[str] = set()
        self.graph_pools = GraphPools(self.hardware.allocator.release_graph_pools)
        self.recorder = Recorder(self.hardware.allocator, windows=True)
        self._mover: Mover = self.mover if self.mover is not None else TorchMover()

    @property
    def after_a_fit(self) -> bool:
        """Whether a try has fitted: the next one starts as the cell's next run will (see ``set_aside``)."""
        return any(t.fitted for t in self.tries)

    def allocated(self, device: int) -> int | None:
        readings = self.hardware.allocator_readings()
        reading = readings.get(device) if readings else None
        return None if reading is None else reading.allocated_bytes

    def run(self, strategy: Strategy, source: str, reason: str, device: int, batch: int | None = None) -> TryResult:
        self._before()
        namespace = self.namespace if isinstance(self.namespace, MutableMapping) else None
        # What the failed cell bound and this try binds again goes to the host first (until a try fits:
        # then the last fitted try's values stay bound, as in the cell's next run).
        steady = self.after_a_fit
        self.set_aside(device)
        before, bound_again = self._bindings_before(namespace)
        grown = self._grown(namespace, bound_again, batch)
        at_start = self.allocated(device)
        # A batch try's allocations are recorded for the search's replay of the allocator (``replay``).
        run = run_measured(lambda: self.run_source(source), Meter(self.hardware, devices=[device]),
                           self.recorder if batch is not None else None, device)
        error, measurement, wall_s, recorded = run.error, run.measurement, run.wall_s, run.recorded
        del run
        for held in grown:
            held.clear()
        if error is not None and namespace is not None and before is not None:
            # A failed try leaves nothing behind: the variables are as the last try that fitted left them,
            # but for what the try bound again before it failed (the old value went, as it does in the
            # cell's next run), which is unbound.
            before.update((name, value) for name, ref in bound_again.items() if (value := ref()) is not None)
            undo_bindings(namespace, before)
        before, bound_again = None, {}
        peak = next((d.peak_above_start_bytes for d in measurement.devices), None)
        # Parsed once (here or by ``oom_of``'s owner); only its figures are kept.
        oom = None if error is None else (self.oom_of or parse_oom)(error)
        message = None if error is None or oom is not None else one_line(error)
        site = None if oom is None or error is None else failure_site(error)
        # Free what this try left (a failed try holds its frames like the original failure did), then
        # let go of the exception: nothing of ours may keep its traceback.
        self.cleanup(error)
        error = None
        if message is None and oom is None:
            self.aside.drop_rebound()  # the try bound its own values: what was set aside is superseded
        left = self.allocated(device)
        # Above the fix's reference level (see ``fix``): what the try started with counts as its own.
        offset = 0 if at_start is None or self.reference is None else at_start - self.reference
        need = needed_bytes(oom, at_start)
        result = TryResult(
            number=len(self.tries) + 1,
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
            failed_at=site,
            steady=steady,
        )
        self.tries.append(result)
        if message is not None:
            # A changed cell that fails otherwise (a shape that needed the old batch...) is not ours
            # to keep retrying; spend no more tries.
            self.stop(f"rerun #{result.number} failed with {message}; stopped")
        return result

    def _bindings_before(self, namespace: MutableMapping[str, Any] | None
                         ) -> tuple[dict[str, Any] | None, dict[str, Callable[[], Any]]]:
        """What a failed try is undone to: the namespace as the try starts, less what the cell binds again
        once a try has fitted (its last values), which is only referred to weakly: held here, it would
        outlive the line that binds it again, which the cell's next run does not let it."""
        if namespace is None:
            return None, {}
        again = set(self.rebinds) if self.after_a_fit else set()
        weak: dict[str, Callable[[], Any]] = {}
        for name in again & set(namespace):
            value = namespace[name]
            if self._mover.holds_gpu(value):
                try:
                    weak[name] = weakref.ref(value)
                except TypeError:  # a tuple of tensors: held, as the old value of a name a failed try bound
                    continue
        return {name: value for name, value in namespace.items() if name not in weak}, weak

    def _grown(self, namespace: Mapping[str, Any] | None, bound_again: Mapping[str, Any], batch: int | None
               ) -> list[list[Any]]:
        """The last fitted try's values the cell binds again, grown to ``batch`` where they hold its rows
        (``Mover.grown``): the cell's next run at ``batch`` holds them at that size until it binds them
        again."""
        last = next((t.batch for t in reversed(self.tries) if t.fitted), None)
        if namespace is None or batch is None or last is None or batch <= last:
            return []
        return [held for name in bound_again if name in namespace
                for held in self._mover.grown(namespace[name], last, batch)]

    def _before(self) -> None:
        if self.before_rerun is not None:
            self.before_rerun()

    def renew_workspaces(self, device: int) -> None:
        """cuBLAS's workspaces freed and made again in segments of their own before a try.

        Why: made during an earlier run while a large freed block was cached, they are carved from it and
        pin its segment, which no ``empty_cache()`` then returns; every later try starts from those
        fragments and the replay, which plays from them, rightly finds less room (on an H100, a DataLoader
        CNN's two 32 MiB workspaces in the middle of a 1.8 GiB segment: the replay put the largest batch at
        274, where 360 fits from a fresh process). Made again only by the try itself, they are carved
        during it instead (an MLP then failed at batches its replay said fit), so they are made at once."""
        self.hardware.allocator.renew_workspaces(device)

    def release_graph_pools(self, device: int) -> None:
        """torch.compile's CUDA graph trees reset before a try where their pools hold memory
        (``reruns.graph_pools``): a pool outlives the try that filled it, and an OOM while a graph is
        recorded leaves the trees failing an assertion at the model's next call. One note, naming the most
        a reset freed (the pools grow with the batch a try recorded)."""
        before = self.graph_pools.note("rerun")
        if self.graph_pools.reset(device):
            note = self.graph_pools.note("rerun") or ""
            if before in self.notes:
                self.notes[self.notes.index(before)] = note
            else:
                self.notes.append(note)

    def left(self) -> int:
        return 0 if self.stopped is not None else self.max_tries - len(self.tries)

    def stop(self, reason: str) -> None:
        if self.stopped is None:
            self.stopped = reason
            self.notes.append(reason)

    def rebound_addresses(self) -> frozenset[int]:
        """Where on the device the values the cell binds again lie (``Mover.addresses``): what the replay
        takes as made anew by the next try (``growth.replay.held_elsewhere``)."""
        namespace = self.namespace
        if namespace is None:
            return frozenset()
        found: set[int] = set()
        for name in self.rebinds:
            if name in namespace:
                found |= self._mover.addresses(namespace[name])
        return frozenset(found)

    def set_aside(self, device: int) -> SetAside:
        """Set aside (``set_aside.set_aside``) what the cell binds again; kept with what earlier tries set
        aside until a try that fits supersedes it or the fix ends.

        Only the failed cell's values: once a try has fitted, what it bound stays bound, and the next try
        holds it until it binds the name again, as the user's next run of the cell will."""
        namespace = self.namespace
        if not isinstance(namespace, MutableMapping) or self.after_a_fit:
            return self.aside
        before = self.allocated(device)
        aside = set_aside(namespace, self.rebinds, self._mover)
        after = self.allocated(device)
        if before is not None and after is not None:
            aside.freed_bytes = max(before - after, 0)
        new = [name for name in aside.names if name not in self.aside.entries]
        if new and not self.tries:
            self.notes.append(
                f"set aside on the host before rerunning (the cell binds them again): {', '.join(new)}"
            )
        for name in aside.kept:
            if name not in self._kept_noted:
                self._kept_noted.add(name)
                self.notes.append(f"could not set aside {name}: its GPU memory stays held during the reruns")
        self.aside.merge(aside)
        return aside
