"""Which lines of the user's code held the memory at the peak, and which keep more every iteration.

``torch.cuda.memory._record_memory_history`` logs every allocation and free with its Python stack;
replaying that log finds the moment the traced allocations peaked and groups what was live then by
the innermost frame that belongs to the user's code (not PyTorch, not a library, not us).

**Growth inside one cell** (``loop_growth``): a loop that keeps something of every iteration leaves
allocations from the same line, of the same sizes, still live at the end of the trace, one set per
iteration. Iterations are counted from the log itself: an allocation of one size at one line happens
once per iteration, so the commonest number of repeats of such (line, size) pairs is the number of
iterations (a pair repeated k times as often belongs k times to each). A line whose kept allocations
come from most iterations (at least three) grew steadily, by what it kept divided by the iterations.
"""

from __future__ import annotations

import linecache
import pickle
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .sources.torch_trace import device_trace, device_traces
from .units import MiB

if TYPE_CHECKING:
    from .sources.base import AllocatorSource

_OURS = "/jupyter_cudamem/"
_LIBRARY_MARKERS = (
    "/site-packages/",
    "/dist-packages/",
    "/torch/",
    _OURS,
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
class LoopGrowth:
    """A line that kept memory from iteration after iteration of a loop.

    ``location``/``code`` is the line that allocated what stays (the innermost frame of the user's
    code), ``called_from``/``called_from_code`` the traced cell's own line that led there when it is
    another one; ``kept_bytes`` what the line's allocations still held when tracing stopped.
    """

    iterations: int
    per_iteration_bytes: int
    kept_bytes: int
    kept_iterations: int
    location: str
    code: str | None
    called_from: str | None = None
    called_from_code: str | None = None


@dataclass(frozen=True)
class TraceSummary:
    device_index: int
    traced_peak_bytes: int  # peak of the allocations made while tracing (what existed before is not in the log)
    sites: tuple[AllocationSite, ...]
    snapshot_path: str | None = None
    events: int = 0
    growth: LoopGrowth | None = None


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


def _outermost(frames: list[dict[str, Any]], is_cell_file: Callable[[str], bool]) -> tuple[str, int, str] | None:
    """The outermost frame of the traced cell's own code (its loop), frames being innermost first. Only the
    frames inside our own are looked at: outside them is the cell as IPython ran it, whose line is the
    magic's call (``get_ipython().run_cell_magic(...)``), not a line the user wrote."""
    outermost = None
    for frame in frames or []:
        filename = str(frame.get("filename", ""))
        if _OURS in filename:
            break
        if filename and is_cell_file(filename):
            outermost = filename, int(frame.get("line", 0)), str(frame.get("name", ""))
    return outermost


# What a loop must show before it is called growing: repeats, and kept allocations from most of them.
MIN_ITERATIONS = 3
MIN_KEPT_BYTES = MiB


_Site = tuple[str, int, str]


def _still_live(
    events: Sequence[Mapping[str, Any]], frees: tuple[str, ...], is_cell_file: Callable[[str], bool] | None
) -> tuple[dict[int, tuple[int, _Site, int, _Site | None]], dict[tuple[_Site, int], int]]:
    """The allocations of user code still live at the trace's end (by address: size, site, which repeat
    of that site and size it was, the cell's outermost frame), and how often each site and size repeated."""
    live: dict[int, tuple[int, _Site, int, _Site | None]] = {}
    repeats: dict[tuple[_Site, int], int] = {}
    for event in events:
        action = event.get("action")
        if action == _ALLOC:
            frames = event.get("frames", [])
            site = _site_of(frames)
            if site is None:
                continue
            size = int(event["size"])
            occurrence = repeats.get((site, size), 0)
            repeats[(site, size)] = occurrence + 1
            outer = _outermost(frames, is_cell_file) if is_cell_file else None
            live[event["addr"]] = (size, site, occurrence, outer)
        elif action in frees:
            live.pop(event.get("addr", -1), None)
    return live, repeats


def loop_growth(
    events: Sequence[Mapping[str, Any]],
    frees: tuple[str, ...] = _FREES,
    describe_file: Callable[[str], str] | None = None,
    source_line: Callable[[str, int], str | None] | None = None,
    is_cell_file: Callable[[str], bool] | None = None,
) -> LoopGrowth | None:
    """The line that kept the most from most iterations of a loop, or ``None`` (see the module docstring)."""
    live, repeats = _still_live(events, frees, is_cell_file)
    counts = [count for count in repeats.values() if count >= MIN_ITERATIONS]
    if not counts:
        return None
    # The commonest repeat count is the loop's; on a tie the smaller (a layer used twice repeats twice as often).
    iterations = max(set(counts), key=lambda count: (counts.count(count), -count))
    kept: dict[tuple[str, int, str], list[tuple[int, int, tuple[str, int, str] | None]]] = {}
    for size, site, occurrence, outer in live.values():
        # A pair repeated k times per iteration: its n-th repeat belongs to iteration n // k.
        iteration = occurrence * iterations // max(repeats[(site, size)], 1)
        kept.setdefault(site, []).append((size, iteration, outer))
    best: LoopGrowth | None = None
    for site, allocations in kept.items():
        kept_bytes = sum(size for size, _, _ in allocations)
        kept_iterations = len({iteration for _, iteration, _ in allocations})
        if kept_bytes < MIN_KEPT_BYTES or kept_iterations < MIN_ITERATIONS or kept_iterations * 2 < iterations:
            continue
        if best is not None and kept_bytes <= best.kept_bytes:
            continue
        filename, line, name = site
        shown = describe_file(filename) if describe_file else filename
        outers = [outer for _, _, outer in allocations if outer is not None and outer != site]
        called_from = called_code = None
        if outers:
            outer = max(set(outers), key=outers.count)
            called_from = f"{describe_file(outer[0]) if describe_file else outer[0]} line {outer[1]}"
            called_code = source_line(outer[0], outer[1]) if source_line else None
        best = LoopGrowth(
            iterations=iterations,
            per_iteration_bytes=kept_bytes // max(iterations, 1),
            kept_bytes=kept_bytes,
            kept_iterations=kept_iterations,
            location=f"{shown} line {line} in {name}",
            code=source_line(filename, line) if source_line else None,
            called_from=called_from,
            called_from_code=called_code,
        )
    return best


def _traced_peak(events: Sequence[Mapping[str, Any]], frees: tuple[str, ...]) -> tuple[int, int]:
    """The most bytes live at once in the trace, and the position of the event that reached it (-1: none)."""
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
    return peak, peak_at


def summarize(
    snapshot: dict[str, Any],
    device_index: int = 0,
    top: int = 5,
    describe_file: Callable[[str], str] | None = None,
    source_line: Callable[[str, int], str | None] | None = None,
    is_cell_file: Callable[[str], bool] | None = None,
) -> TraceSummary:
    """Replay the device's trace, rank user code sites by bytes live at the traced peak, and find a
    loop that kept memory from iteration after iteration (``is_cell_file`` tells the traced cell's
    own code apart, to name the cell's line that led to it)."""
    events = device_trace(snapshot, device_index)
    has_completed = any(event.get("action") in _FREES for event in events)
    frees = _FREES if has_completed else (_FREE_FALLBACK,)

    peak, peak_at = _traced_peak(events, frees)
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
    growth = loop_growth(events, frees, describe_file, source_line, is_cell_file)
    return TraceSummary(
        device_index=device_index, traced_peak_bytes=peak, sites=tuple(sites), events=len(events), growth=growth
    )


def save_snapshot(snapshot: dict[str, Any], path: str | Path) -> Path:
    """Write the snapshot as ``torch.cuda.memory._dump_snapshot`` does, for pytorch.org/memory_viz."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("wb") as handle:
        pickle.dump(snapshot, handle)
    return target


@contextmanager
def traced(
    allocator: AllocatorSource,
    max_entries: int,
    directory: str | Path,
    cell_number: int | None,
    describe_file: Callable[[str], str],
) -> Iterator[list[TraceSummary]]:
    """Record the allocations of the block run inside (at most ``max_entries`` events); when it ends, save the
    snapshot in ``directory`` as ``cell<N>-<time>.pickle`` and fill the list yielded with one summary per
    device that allocated. ``describe_file`` names a code object's file as the user knows it (``In[3]``)."""
    summaries: list[TraceSummary] = []
    allocator.start_trace(max_entries)
    try:
        yield summaries
    finally:
        snapshot = allocator.stop_trace()
        path = save_snapshot(snapshot, Path(directory) / f"cell{cell_number}-{time.strftime('%Y%m%d-%H%M%S')}.pickle")
        cell_name = f"In[{cell_number}]"
        for index, events in enumerate(device_traces(snapshot)):
            if not events:
                continue
            summary = summarize(
                snapshot,
                index,
                describe_file=describe_file,
                source_line=lambda f, n: linecache.getline(f, n) or None,
                is_cell_file=lambda f: describe_file(f) == cell_name,
            )
            summaries.append(replace(summary, snapshot_path=str(path)))
