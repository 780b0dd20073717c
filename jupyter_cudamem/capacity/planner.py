"""The capacity feature's driver: from a cell and the hardware, the runs and the plan (``%%cudamem_plan``).

It finds the batch where ``%oomfix`` finds it (``batch.find_batch``), decides what to run (the batch as written,
a smaller one, under autocast, a calibration at the smallest card), has ``runs`` measure them, and builds
``plan``'s plan. The magic (``magics/plan.py``) parses the options, hands over how to run a cell through the
shell and how to keep it quiet, and shows the result: nothing here displays.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ContextManager

from ..batch import BatchChange, BatchFinding, Knob, find_batch
from ..cell.edit import AutocastNotApplicable, wrap_in_autocast
from ..cell.read import ReadCell, read_cell
from ..cell.traits import CellTraits
from ..errors import CudaMemError
from ..hardware import Hardware
from ..measure import Meter
from ..oom import is_cuda_oom
from ..reruns.graph_pools import GraphPools
from ..reruns.model_state import Restorer, what_to_restore
from ..reruns.recording import Recorder
from ..reruns.set_aside import set_aside
from ..sources.torch_device import default_autocast_dtype
from ..repeats import source_key
from ..sources.torch_host import TorchMover
from ..units import GiB
from .cards import Card
from .plan import CapacityPlan, build_plan, usable_bytes
from .runs import CalibrationScale, Measured, Runner, history_match, judge, measure_runs

if TYPE_CHECKING:
    from ..history import CellRecord


@dataclass(frozen=True)
class PlanOptions:
    """What the user asked for: ``margin`` ``None`` takes ``default_margin`` (``calibrated_margin`` for a
    calibrated plan); ``small`` the second batch (``None``: half the batch as written). Checked when made,
    so options out of range are refused before anything runs, whoever makes them."""

    cards: Sequence[Card]
    default_margin: float
    calibrated_margin: float
    margin: float | None = None
    autocast: bool = False
    small: int | None = None
    calibrate: bool = False

    def __post_init__(self) -> None:
        """A one-line error for a margin out of range, or a second batch that is no batch (whatever the cell)."""
        margin = self.default_margin if self.margin is None else self.margin
        if not 0 <= margin < 1:
            raise CudaMemError(f"--margin takes a fraction from 0 up to (not including) 1, such as 0.05; got {margin}")
        if self.small is not None and (isinstance(self.small, bool) or self.small < 1):
            raise CudaMemError(f"--small takes the second batch size to measure, a whole number from 1 up (other than "
                               f"the cell's own batch); got {self.small}")
        if self.calibrate and not 0 <= self.calibrated_margin < 1:
            raise CudaMemError(
                f"CudaMemPlan.calibrated_margin takes a fraction from 0 to 1 such as 0.03, got {self.calibrated_margin}: "
                "set it with %config CudaMemPlan.calibrated_margin = 0.03"
            )


@dataclass(frozen=True)
class CellAccess:
    """How the planner reaches the cell's world: its namespace, IPython's input transform and history, the
    cell's number, a way to run a source as a cell (``run``) and to keep a run quiet (``quiet``)."""

    namespace: dict[str, object]
    transform: Callable[[str], str]
    history: list[str]
    cell_number: int | None
    run: Callable[[str], object]
    quiet: Callable[[], ContextManager[object]]


def runs_restorer(cell: ReadCell, access: CellAccess, notes: list[str]) -> Restorer | None:
    """What puts the cell's training state and plain values back, after the last run, as the first run at the
    batch as written left them (``runs.measure_runs``'s ``after_first``): the plan's extra runs leave no
    steps in the model and no entries in the lists it appends to. ``None`` where the cell changes neither."""
    trained, copy, too_large = what_to_restore(cell, access.namespace, no_restore=False, can_ask=True)
    if too_large is not None:
        notes.append(f"the training steps of the plan's runs stay in {trained.describe()}: "
                     "a copy of its state would not fit in host memory")
    if not copy and trained.plain.empty:
        return None
    return Restorer(trained, access.namespace, copy_training=copy)


def kept_as_one_run(restorer: Restorer) -> list[str]:
    """What the plan says it put back after its runs."""
    names = [restorer.state.describe()] if restorer.copy_training and restorer.restores else []
    names += restorer.state.plain.changed
    if not names:
        return []
    return [f"{', '.join(names)} put back after the plan's runs as its first run at the batch as written left them"]


def _not_measured(hardware: Hardware) -> str:
    """How the memory outside PyTorch was counted where NVML could not read it."""
    why = hardware.nvml.status() or "NVML could not be read"
    return f"NOT measured ({why}): counted as 0, so every card's usable memory is overstated by it"


def _margin(options: PlanOptions, calibrated: bool) -> float:
    """``--margin`` where given, else the default, smaller for a calibrated plan."""
    if options.margin is not None:
        return options.margin
    return options.calibrated_margin if calibrated else options.default_margin


def _check_small(small: int, finding: BatchFinding, batch: int | None) -> None:
    """``--small``: a batch to measure beside the cell's own, which needs a batch and another size."""
    if finding.chosen is None:
        raise CudaMemError(f"--small: {finding.summary()}")
    if small < 1 or small == batch:
        raise CudaMemError(f"--small takes a batch size of at least 1 other than {batch}, got {small}")


def _under_autocast(
    cell: str, knob: Knob | None, traits: CellTraits, access: CellAccess, notes: list[str]
) -> tuple[str | None, str | None]:
    """``--autocast``: the cell wrapped in autocast and its dtype; no source, and why in ``notes``, where
    there is no batch to compare, the cell runs under autocast already, or it cannot be wrapped."""
    if knob is None:
        notes.append("--autocast needs a batch to compare per-sample memory: not run")
        return None, None
    if traits.autocast:
        notes.append("the cell already runs under autocast: --autocast adds nothing")
        return None, None
    dtype = default_autocast_dtype()
    try:
        source = wrap_in_autocast(cell, dtype, import_torch="torch" not in access.namespace, transform=access.transform)
    except SyntaxError as error:
        raise CudaMemError(f"--autocast: the cell does not parse ({error.msg}); nothing ran") from None
    except AutocastNotApplicable as reason:
        notes.append(f"--autocast not run: {reason}")
        return None, dtype
    return source, dtype


def plan_cell(cell: str, options: PlanOptions, access: CellAccess, hardware: Hardware,
              history_records: Sequence[CellRecord] = ()) -> tuple[CapacityPlan, Measured]:
    """Measure ``cell`` and plan it. The cell's own errors propagate from ``access.run`` (the magic shows
    them as a plain cell does); ours are ``CudaMemError``."""
    finding = find_batch(cell, access.namespace, access.transform, history=access.history,
                         cell_number=access.cell_number)
    knob = finding.chosen
    batch = knob.value if knob is not None else None
    notes: list[str] = []
    if options.small is not None:
        _check_small(options.small, finding, batch)
    if knob is None:
        notes.append(f"{finding.summary()}: measured once and planned as fixed-size")
    read = read_cell(cell, access.transform)  # its names serve every run: a run changes the batch, not the names
    traits = read.traits
    autocast_source, dtype = _under_autocast(cell, knob, traits, access, notes) if options.autocast else (None, None)

    change = BatchChange(finding, knob, access.namespace, access.history) if knob is not None else None
    # Tensors only: a plan must leave the cell's objects as they were, and a module moved in place would be
    # seen on the host by whatever else refers to it; a module the cell binds again stays bound (it is the
    # cell's fixed part).
    tensors_only = TorchMover(tensors_only=True)
    restorer = runs_restorer(read, access, notes) if knob is not None else None
    graph_pools = GraphPools(hardware.allocator.release_graph_pools)
    runner = Runner(Meter(hardware, reset_peak=True), run=access.run if restorer is None else restorer.run(access.run),
                    is_oom=is_cuda_oom,
                    release=hardware.allocator.empty_cache, quiet=access.quiet,
                    set_aside=lambda source: set_aside(access.namespace, read.rebinds, tensors_only),
                    recorder=Recorder(hardware.allocator), graph_pools=graph_pools)
    calibrate_at = None
    if options.calibrate:
        if knob is None:
            notes.append("--calibrate needs a batch to search: not calibrated")
        else:
            calibrate_at = lambda: calibration_scale(hardware, runner.measured, options.cards)  # noqa: E731
    try:
        measured = measure_runs(runner, cell, batch, change, options.small, autocast_source, calibrate_at,
                                cap_at=lambda usable: hardware.capped(usable, runner.measured.devices(), unread_fraction=None),
                                after_first=None if restorer is None else restorer.take)
    finally:
        if restorer is not None:
            restorer.finish(last_fitted=False)  # back to what the first run left: one plain run's state
    if restorer is not None:
        notes.extend(kept_as_one_run(restorer))
    pools_note = graph_pools.note("run")
    if pools_note is not None:
        notes.append(pools_note)
    gc.collect()

    history_peak = None
    if batch is not None:
        history_peak = next(history_match(history_records, source_key(cell), batch), None)
    judged = judge(measured, batch, history_peak)
    how = measured.non_pytorch_how or _not_measured(hardware)
    calibration = measured.calibration if judged.line is not None else None
    margin = _margin(options, calibration is not None)
    plan = build_plan(
        measured.runs, batch, knob.label if knob is not None else None, options.cards, margin,
        measured.non_pytorch_bytes, how, this_card(hardware, measured), judged.line, judged.autocast_line, dtype,
        judged.agreements, notes + measured.notes + list(judged.notes), traits.trains,
        finding.summary() if knob is not None else "", judged.reserved_line, calibration, judged.replay_runs,
        judged.workspaces_optional,
    )
    return plan, measured


def this_card(hardware: Hardware, measured: Measured) -> tuple[str, int] | None:
    """The card the runs used, as a plan's card: under a per-process cap, what the cap leaves."""
    if measured.total_bytes is None:
        return None
    name, total = measured.device_name or "this card", measured.total_bytes
    fraction = None if measured.torch_index is None else hardware.memory_fraction(measured.torch_index)
    if fraction is not None and fraction < 1:
        # PyTorch may reserve ``fraction x total``; the memory outside PyTorch comes on top of it.
        capped = int(fraction * total) + measured.non_pytorch_bytes
        if capped < total:
            return f"{name}, PyTorch capped at {fraction * total / GiB:.1f} GiB", capped
    return name, total


def calibration_scale(hardware: Hardware, measured: Measured, cards: Sequence[Card]) -> CalibrationScale | None:
    """Where --calibrate searches (``runs.CalibrationScale``): the smallest card of the plan smaller than
    this one, played by capping PyTorch here, or this card itself."""
    here = this_card(hardware, measured)
    if here is None or measured.torch_index is None or not measured.total_bytes:
        return None
    usable_here = usable_bytes(here[1], measured.non_pytorch_bytes)
    smaller = sorted((usable_bytes(card.total_bytes, measured.non_pytorch_bytes), card.name) for card in cards)
    smaller = [(usable, name) for usable, name in smaller if 0 < usable < usable_here]
    # A cap we cannot read is one we must not overwrite: then this card itself.
    if not smaller or hardware.memory_fraction(measured.torch_index) is None:
        return CalibrationScale(usable_here, here[0])
    usable, name = smaller[0]
    return CalibrationScale(usable, name, lambda: hardware.capped(usable, measured.devices(), unread_fraction=None))
