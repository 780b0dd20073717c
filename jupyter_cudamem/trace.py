"""Which lines of the user's code held the memory at the peak, from an allocator snapshot.

``torch.cuda.memory._record_memory_history`` logs every allocation and free with its Python stack;
replaying that log finds the moment the traced allocations peaked and groups what was live then by
the innermost frame that belongs to the user's code (not PyTorch, not a library, not us).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_LIBRARY_MARKERS = (
    "/site-packages/",
    "/dist-packages/",
    "/torch/",
    "/jupyter_cudamem/",
    "/IPython/",
    "/ipykernel/",
    "<frozen ",
    "/lib/python3",
)
_ALLOC = "alloc"
_FREES = ("free_completed",)
_FREE_FALLBACK = "free_requested"


@dataclass(frozen=True)
class AllocationSite:
    """A place in the user's code and what its allocations held at the peak."""

    location: str  # "In[3] line 2 in <module>" or "train.py:41 in step"
    code: str | None
    bytes_at_peak: int
    allocations: int


@dataclass(frozen=True)
class TraceSummary:
    device_index: int
    traced_peak_bytes: int  # peak of the allocations made while tracing (what existed before is not in the log)
    sites: tuple[AllocationSite, ...]
    snapshot_path: str | None = None
    events: int = 0


def _is_user_frame(frame: dict[str, Any]) -> bool:
    filename = str(frame.get("filename", ""))
    if not filename or filename.startswith("??"):
        return False
    return not any(marker in filename for marker in _LIBRARY_MARKERS)


def _site_of(frames: list[dict[str, Any]]) -> tuple[str, int, str] | None:
    """The innermost user frame (torch lists frames innermost first)."""
    for frame in frames or []:
        if _is_user_frame(frame):
            return str(frame.get("filename")), int(frame.get("line", 0)), str(frame.get("name", ""))
    return None


def summarize(
    snapshot: dict[str, Any],
    device_index: int = 0,
    top: int = 5,
    describe_file: Callable[[str], str] | None = None,
    source_line: Callable[[str, int], str | None] | None = None,
) -> TraceSummary:
    """Replay the device's trace and rank user code sites by bytes live at the traced peak."""
    traces = snapshot.get("device_traces") or []
    events = traces[device_index] if device_index < len(traces) else []
    has_completed = any(event.get("action") in _FREES for event in events)
    frees = _FREES if has_completed else (_FREE_FALLBACK,)

    live: dict[int, int] = {}
    total = 0
    peak = 0
    peak_at = -1
    for position, event in enumerate(events):
        action = event.get("action")
        if action == _ALLOC:
            live[event["addr"]] = int(event["size"])
            total += int(event["size"])
            if total > peak:
                peak, peak_at = total, position
        elif action in frees and event.get("addr") in live:
            total -= live.pop(event["addr"])

    # Replay again up to the peak, keeping which site each live allocation came from.
    at_peak: dict[int, tuple[int, tuple[str, int, str] | None]] = {}
    for event in events[: peak_at + 1]:
        action = event.get("action")
        if action == _ALLOC:
            at_peak[event["addr"]] = (int(event["size"]), _site_of(event.get("frames", [])))
        elif action in frees:
            at_peak.pop(event.get("addr"), None)

    grouped: dict[tuple[str, int, str] | None, list[int]] = {}
    for size, site in at_peak.values():
        grouped.setdefault(site, []).append(size)
    ranked = sorted(grouped.items(), key=lambda item: -sum(item[1]))[:top]
    sites = []
    for site, sizes in ranked:
        if site is None:
            location, code = "inside libraries (no frame of your code on the stack)", None
        else:
            filename, line, name = site
            shown = describe_file(filename) if describe_file else filename
            location = f"{shown} line {line} in {name}"
            code = source_line(filename, line) if source_line else None
        sites.append(AllocationSite(location, code, sum(sizes), len(sizes)))
    return TraceSummary(device_index=device_index, traced_peak_bytes=peak, sites=tuple(sites), events=len(events))


def save_snapshot(snapshot: dict[str, Any], path: str | Path) -> Path:
    """Write the snapshot as ``torch.cuda.memory._dump_snapshot`` does, for pytorch.org/memory_viz."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("wb") as handle:
        pickle.dump(snapshot, handle)
    return target
