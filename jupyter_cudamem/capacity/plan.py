"""The capacity plan as ``%%cudamem_plan`` hands it on: built from the runs (``build_plan``) and shown as text,
HTML and a figure (``render``, ``figure``). The arithmetic of the prediction is ``prediction``'s; its names
are importable from here too."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..errors import CudaMemError
from ..growth.line import Agreement, Line
from .cards import Card
from .figure import plan_figure
from .prediction import (
    CALIBRATED_MARGIN,
    DEFAULT_MARGIN,
    Calibration,
    CardPlan,
    PlanFigures,
    Run,
    autocast_largest,
    calibrated,
    largest_batch,
    plan_card,
    plan_largest,
    replay_margin,
    replayed_largest,
    usable_bytes,
)
from .render import plan_html, plan_text

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "CALIBRATED_MARGIN", "DEFAULT_MARGIN", "Calibration", "CapacityPlan", "CardPlan", "PlanFigures", "Run",
    "autocast_largest", "build_plan", "calibrated", "largest_batch", "plan_card", "plan_largest", "replay_margin",
    "replayed_largest", "usable_bytes",
]


class CapacityPlan(PlanFigures):
    """The plan's figures with their presentation: its repr is the plan as text (``-o``, ``Out[N]``), its HTML
    the table with the figure, ``figure()`` the matplotlib figure."""

    def text(self) -> str:
        return plan_text(self)

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        printer.text("CapacityPlan(...)" if cycle else self.text())

    def _repr_html_(self) -> str:
        return plan_html(self)

    def figure(self) -> Figure:
        """A matplotlib figure: peak against batch, the measured points, each card's usable memory."""
        return plan_figure(self)



def build_plan(
    runs: Sequence[Run],
    batch: int | None,
    knob: str | None,
    cards: Sequence[Card],
    margin: float,
    non_pytorch_bytes: int,
    non_pytorch_how: str,
    this_card: tuple[str, int] | None = None,
    line: Line | None = None,
    autocast_line: Line | None = None,
    autocast_dtype: str | None = None,
    agreements: Sequence[Agreement] = (),
    notes: Sequence[str] = (),
    trains: bool = True,
    batch_where: str = "",
    reserved_line: Line | None = None,
    calibration: Calibration | None = None,
    replay_runs: tuple[Run, Run] | None = None,
    workspaces_optional: bool = False,
) -> CapacityPlan:
    """The plan for every card, from a fitted ``line`` (or the one peak of a cell with no batch).
    With a ``calibration`` (``runs.calibrate``) the line is scaled by its ratio on every card
    (``calibrated``); else, with the line's two runs recorded (``replay_runs``: smaller batch, larger
    batch), the allocator's replay of them gives each card's largest batch (``replayed_largest``), with
    the workspaces given back at once as optional where ``workspaces_optional``."""
    flat = line is not None and line.slope_bytes <= 0  # the peak is a phase no batch changes (``runs.judge``)
    ratio = calibration.ratio(line) if calibration is not None and line is not None and not flat else None
    replayed = None
    if ratio is None and line is not None and batch is not None and replay_runs is not None:
        replayed = replayed_largest(*replay_runs, replay_margin(margin), workspaces_optional)
    if flat and replayed is None:
        raise CudaMemError("the peak did not grow with the batch and the runs' allocations could not be replayed: "
                           "no largest batch to predict; plan it at two batches whose peaks differ (--small N)")
    if flat and calibration is not None:
        notes = (*notes, "--calibrate: a flat line has no ratio to scale; the allocator's replay decides")
    fixed_peak = None
    if line is None:
        peaks = [r.peak_bytes for r in runs if not r.oom and not r.autocast and r.peak_bytes is not None]
        fixed_peak = max(peaks) if peaks else None
    plans = tuple(
        plan_card((card.name, card.total_bytes), line, fixed_peak, batch, non_pytorch_bytes, margin, autocast_line,
                  reserved_line=reserved_line, ratio=ratio, replayed=replayed)
        for card in cards
    )
    here = None
    if this_card is not None:
        here = plan_card(this_card, line, fixed_peak, batch, non_pytorch_bytes, margin, autocast_line, this_card=True,
                         reserved_line=reserved_line, ratio=ratio, replayed=replayed)
    return CapacityPlan(
        tuple(runs), batch, knob, line, fixed_peak, non_pytorch_bytes, non_pytorch_how, margin, plans, here,
        tuple(agreements), autocast_line, autocast_dtype, tuple(notes), trains, batch_where, reserved_line,
        calibration if ratio is not None else None, replayed is not None, replayed is not None and workspaces_optional,
    )
