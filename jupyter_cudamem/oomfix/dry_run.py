"""``%oomfix --dry-run``: the plan beside the diagnosis (which knob, where it lives, the first try), from
the batch's finding and the free memory, measured where a GPU can be read, else as the error message
reported it. Runs nothing; needs no GPU."""

from __future__ import annotations

from typing import Any

from ..cell.read import ReadCell
from ..hardware import Hardware
from ..oom import OomInfo, oom_device
from .outcome import Outcome
from .strategies import Strategy


def dry_run(
    cell: ReadCell,
    oom: OomInfo | None,
    diagnosis: Any,
    strategies: tuple[Strategy, ...],
    max_tries: int,
    cell_number: int | None,
    *,
    namespace: dict[str, Any],
    history: list[str],
    hardware: Hardware,
    margin: float,
) -> Outcome:
    """The preview ``--dry-run`` shows for ``cell`` (``cell.read.read_cell``): the diagnosis and the plan."""
    from ..batch import find_batch
    from ..hardware import headroom_bytes
    from .plan import budget_from_message, plan_batch, preview

    source = cell.source
    if cell_number is None:  # the failure was found without its count: the last time this source ran
        cell_number = next((k for k in range(len(history) - 1, 0, -1) if history[k] == source), None)
    finding = find_batch(source, namespace, cell.transform, history=history, cell_number=cell_number)
    measured = headroom_bytes(hardware, oom_device(oom)) if hardware.allocator.status() is None else None
    budget = measured if measured is not None else budget_from_message(oom)
    plan = plan_batch(finding, namespace, history, budget, strategies,
                      max_tries=max_tries, margin=margin,
                      budget_source="the measured" if measured is not None else "the error message's")
    return preview(source, finding, plan, diagnosis, measured)
