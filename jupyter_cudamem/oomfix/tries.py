"""The measured tries of one ``%oomfix``: each rerun starts where the failed cell started (what it binds
again set aside on the host), runs measured, is undone when it fails, and counts against ``max_tries``.
Apart from the driver: this knows how a try is made and read, not why it was chosen.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    import torch

RunSource = Callable[[str], "BaseException | None"]
Cleanup = Callable[["BaseException | None"], object]


def lacked_bytes(oom: OomInfo) -> int | None:
    """How much more room the allocation that failed needed than the process had then: the request less
    what was free for it (under a per-process cap, the room under it); ``None`` where the message does not say."""
    free = [room for room in (oom.room_under_cap_bytes, oom.free_bytes) if room is not None]
    if oom.requested_bytes is None or not free:
        return None
    return max(oom.requested_bytes - max(min(free), 0), 0)


def needed_bytes(oom: OomInfo | None, allocated_before: int | None) -> int | None:
    """A lower bound of what the failed cell needs above what it started with: what it had allocated
    when it failed (less what was allocated when it started), plus the allocation that failed."""
    if oom is None or allocated_before is None or oom.allocated_bytes is None or oom.requested_bytes is None:
        return None
    return max(oom.allocated_bytes - allocated_before, 0) + oom.requested_bytes


def failure_site(error: BaseException) -> FailureSite | None:
    """Where in the cell ``error`` arose: the line of its first ``<module>`` frame, and whether a model's
    forward pass (a frame whose ``self`` is a module) lies below it; ``None``: no frame of the cell."""
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
    """The tries of one fix; the fields as ``Driver``'s. ``rebinds``: the names the failed cell binds again
    (``ReadCell.rebinds``), every try's too (a try changes its batch, not its names)."""

    run_source: RunSource
    hardware: Hardware
    cleanup: Cleanup
    max_tries: int
    mover: Mover | None = None
    oom_of: Callable[[BaseException], OomInfo | None] | None = None
    before_rerun: Callable[[], object] | None = None
    rebinds: tuple[str, ...] = ()
    held_for_step: Callable[[], Sequence[object]] | None = None
    tries: list[TryResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    namespace: Mapping[str, object] | None = None
    stopped: str | None = None  # why no more tries are made (never an overwrite of max_tries)
    aside: SetAside = field(default_factory=lambda: SetAside({}))  # on the host until a try that fits binds it anew
    reference: int | None = None  # allocated bytes every try's figures are taken from

    def __post_init__(self) -> None:
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
        if self.before_rerun is not None:
            self.before_rerun()
        namespace = self.namespace if isinstance(self.namespace, MutableMapping) else None
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
            # Undone, but what the try bound again before it failed stays unbound (its old value went).
            before.update((name, value) for name, ref in bound_again.items() if (value := ref()) is not None)
            restore_bindings(namespace, before)
        before, bound_again = None, {}
        peak = next((d.peak_above_start_bytes for d in measurement.devices), None)
        oom = None if error is None else (self.oom_of or parse_oom)(error)
        message = None if error is None or oom is not None else one_line(error)
        site = None if oom is None or error is None else failure_site(error)
        # Free what this try left, then let go of the exception: nothing of ours may keep its traceback.
        self.cleanup(error)
        error = None
        fitted = message is None and oom is None
        if fitted:
            self.aside.drop_rebound()  # the try bound its own values: what was set aside is superseded
        left = self.allocated(device)
        result = TryResult(
            number=len(self.tries) + 1, strategy=strategy, source=source, fitted=fitted, out_of_memory=oom is not None,
            peak_bytes=peak, wall_s=wall_s, reason=reason, batch=batch, error=message, failed_at=site,
            allocated_at_start_bytes=at_start, left_bytes=None if left is None or at_start is None else left - at_start,
            start_above_reference_bytes=0 if at_start is None or self.reference is None else at_start - self.reference,
            need_bytes=needed_bytes(oom, at_start), stuck_bytes=None if oom is None else oom.reserved_unallocated_bytes,
            recorded=recorded, steady=steady)
        self.tries.append(result)
        if message is not None:
            # A changed cell that fails otherwise is not ours to keep retrying.
            self.stop(f"rerun #{result.number} failed with {message}; stopped")
        return result

    def _bindings_before(self, namespace: MutableMapping[str, object] | None
                         ) -> tuple[dict[str, object] | None, dict[str, Callable[[], object]]]:
        """What a failed try is undone to: the namespace as the try starts; once a try has fitted, what the
        cell binds again only weakly, as the cell's next run lets it go at the line that binds it again."""
        if namespace is None:
            return None, {}
        again = set(self.rebinds) if self.after_a_fit else set()
        weak: dict[str, Callable[[], object]] = {}
        for name in again & set(namespace):
            value = namespace[name]
            if self._mover.holds_gpu(value):
                try:
                    weak[name] = weakref.ref(value)
                except TypeError:  # a tuple of tensors: held, as the old value of a name a failed try bound
                    continue
        return {name: value for name, value in namespace.items() if name not in weak}, weak

    def _grown(self, namespace: Mapping[str, object] | None, bound_again: Mapping[str, object], batch: int | None
               ) -> list[list[torch.Tensor]]:
        """The last fitted try's values the cell binds again, grown to ``batch`` where they hold its rows,
        as the cell's next run at ``batch`` holds them until it binds them again."""
        last = next((t.batch for t in reversed(self.tries) if t.fitted), None)
        if namespace is None or batch is None or last is None or batch <= last:
            return []
        return [held for name in bound_again if name in namespace
                for held in self._mover.grown(namespace[name], last, batch)]

    def release_graph_pools(self, device: int) -> None:
        """torch.compile's CUDA graph trees reset before a try where their pools hold memory
        (``reruns.graph_pools``), with one note naming the most a reset freed."""
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

    def rebound_addresses(self) -> tuple[frozenset[int], ...]:
        """Where on the device the values the cell binds again lie, name by name (``rebinds``' order; none
        where a name is unbound): what the replay takes as made anew where the run binds the name."""
        namespace = self.namespace or {}
        return tuple(self._mover.addresses(namespace[name]) if name in namespace else frozenset()
                     for name in self.rebinds)

    def released_addresses(self) -> frozenset[int]:
        """Where on the device what the put-back holds until the optimizer's next step lies."""
        return frozenset() if self.held_for_step is None else self._mover.addresses(list(self.held_for_step()))

    def set_aside(self, device: int) -> SetAside:
        """Set aside what the failed cell binds again, until a try that fits supersedes it or the fix ends;
        once a try has fitted, its values stay bound, as in the user's next run."""
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
            self.notes.append(f"set aside on the host before rerunning (the cell binds them again): {', '.join(new)}")
        for note in (f"could not set aside {name}: its GPU memory stays held during the reruns" for name in aside.kept):
            if note not in self.notes:
                self.notes.append(note)
        self.aside.merge(aside)
        return aside
