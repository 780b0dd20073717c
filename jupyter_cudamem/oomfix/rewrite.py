"""The driver's way to the batch finder until it changes knobs where they live (issue 10's integration).

``jupyter_cudamem.batch`` finds the batch wherever it lives and changes it there (``BatchChange``).
The driver of today only reruns a cell's *text*, so this adapter hands it the knobs that text can
set: numbers written in the failed cell, and variables set in an earlier cell (assigned anew on the
cell's first line, as before). Knobs that live in objects (a config field, a DataLoader, a Trainer's
arguments) are shown in the summary but not chosen here. Delete this module once the driver uses
``BatchChange``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from ..batch import BatchFinding, Knob
from ..batch import find_batch as find_anywhere
from ..batch.change import text_change
from ..batch.knobs import Value
from ..batch.names import batch_like as batch_like
from ..cell.edit import unified_diff as unified_diff
from ..cell.edit import wrap_in_autocast as wrap_in_autocast
from ..cell.source import default_transform as _default_transform

BatchDiscovery = BatchFinding
__all__ = [
    "BatchDiscovery",
    "_default_transform",
    "batch_like",
    "find_batch",
    "rewrite_batch",
    "unified_diff",
    "wrap_in_autocast",
]


def _set_by_text(knob: Knob) -> bool:
    return all(isinstance(t, Value) and not t.path.steps for t in knob.live)


def find_batch(
    source: str,
    namespace: Mapping[str, Any] | None = None,
    transform: Callable[[str], str] | None = None,
) -> BatchFinding:
    """The finder's knobs, the ones the cell's text can set first (see the module docstring)."""
    finding = find_anywhere(source, namespace, transform)
    usable = tuple(k for k in finding.knobs if k.changeable and _set_by_text(k))
    rest = tuple(k for k in finding.knobs if k not in usable)
    problem = finding.problem
    if not usable and problem is None:
        problem = "the batch size lives outside the cell's text (" + finding.knobs[0].describe() + ")"
    demoted = tuple(replace(k, problem=k.problem or "set where it lives only by the new driver") for k in rest)
    return replace(finding, knobs=usable + demoted, problem=problem)


def rewrite_batch(discovery: BatchFinding, new_value: int, candidate: Knob | None = None) -> str:
    """``discovery.source`` with the (chosen) knob set to ``new_value`` by its text."""
    candidate = candidate or discovery.chosen
    if candidate is None:
        raise ValueError("nothing to rewrite: " + discovery.summary())
    if new_value < 1:
        raise ValueError(f"a batch size must be at least 1, got {new_value}")
    return text_change(discovery, candidate, new_value)
