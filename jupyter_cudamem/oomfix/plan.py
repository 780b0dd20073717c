"""What ``%oomfix`` would do, without doing it: the plan ``--dry-run`` shows beside the diagnosis (the knob,
where it lives, the search's own first try and its diffs), from the free memory measured where a GPU can
be read, else as the error message reported it. Runs nothing, changes nothing, needs no GPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ..batch import BatchChange, BatchFinding, find_batch
from ..cell.edit import CellDiff
from ..cell.read import ReadCell
from ..hardware import Hardware, headroom_bytes
from ..oom import OomInfo, oom_device
from ..batchsearch import BatchSearch
from .outcome import BatchPlan, Outcome
from .request import FixRequest
from .strategies import Strategy
from .whole_data import whole_data_decision

if TYPE_CHECKING:
    from .diagnosis import Diagnosis


def budget_from_message(oom: OomInfo | None) -> int | None:
    """What the error message says was free for the cell when it failed (free plus cached but unallocated):
    a floor of the room after the cleanup, which frees what the failure held."""
    if oom is None or oom.free_bytes is None:
        return None
    room = oom.free_bytes + (oom.reserved_unallocated_bytes or 0)
    if oom.room_under_cap_bytes is not None:
        room = min(room, oom.room_under_cap_bytes + (oom.reserved_unallocated_bytes or 0))
    return room


def plan_batch(finding: BatchFinding, namespace: Mapping[str, object] | None, history: Sequence[str] | None,
               budget_bytes: int | None, strategies: tuple[Strategy, ...], max_tries: int = 3, margin: float = 0.04,
               budget_source: str = "measured") -> BatchPlan:
    """The plan for a failed cell: its knob and the search's first try (nothing is changed)."""
    knob = finding.chosen
    notes = finding.notes
    original = finding.source

    def planned(reason: str, first: int | None = None, diffs: tuple[CellDiff, ...] = ()) -> BatchPlan:
        return BatchPlan(finding.summary(), knob, first, reason, diffs, strategies, notes)

    whole = whole_data_decision(finding, namespace) if Strategy.BATCH in strategies else None
    if whole is not None:  # the batch is the data: chunks over all of it, or no batch try at all
        notes = notes + (whole.note,)
        if whole.chunked is None:
            return planned("none: the batch is the data")
        finding, knob = whole.chunked, whole.chunked.chosen
    if knob is None or Strategy.BATCH not in strategies:
        return planned("")
    if knob.value < 2:
        return planned(f"none: the batch is already {knob.value}")
    if budget_bytes is None:
        return planned("chosen once the free memory is measured after the cleanup (it cannot be read here)")
    first = BatchSearch(knob.value, budget_bytes, max_tries=max_tries, margin=margin).next()
    if first is None:
        return planned("none: the search sees nothing smaller worth trying")
    change = BatchChange(finding, knob, dict(namespace or {}), history)
    diffs = change.diffs(first)
    if whole is not None:  # the diff is from the cell as the user wrote it, not from our chunked form
        diffs = (CellDiff("the failed cell", original, change.source_for(first), None),)
    return planned(f"the search's first choice with {budget_source} free memory", first, diffs)


def dry_run(request: FixRequest, cell: ReadCell, diagnosis: Diagnosis, namespace: dict[str, object], history: list[str],
            hardware: Hardware) -> Outcome:
    """The preview ``--dry-run`` shows for ``cell`` (``cell.read.read_cell``): the diagnosis and the plan."""
    cell_number = request.cell_number
    if cell_number is None:  # the failure was found without its count: the last time this source ran
        cell_number = next((k for k in range(len(history) - 1, 0, -1) if history[k] == cell.source), None)
    finding = find_batch(cell, namespace, history=history, cell_number=cell_number)
    measured = headroom_bytes(hardware, oom_device(request.oom)) if hardware.allocator.status() is None else None
    budget = measured if measured is not None else budget_from_message(request.oom)
    plan = plan_batch(finding, namespace, history, budget, request.strategies, max_tries=request.max_tries,
                      margin=request.margin,
                      budget_source="the measured" if measured is not None else "the error message's")
    return Outcome(cell.source, None, None, (), batch_summary=finding.summary(), budget_bytes=measured, dry_run=True,
                   diagnosis=diagnosis, plan=plan, notes=request.limit_notes, verbose=request.verbose,
                   cell_name=request.cell_name)
