"""The tracker's figures made to agree with the allocator's measured peak: categories and modules each sum to
it, ``Category.OTHER`` and ``OTHER_MODULE`` taking what the tracker did not see."""

from __future__ import annotations

from collections.abc import Mapping

from .categories import MAX_MODULES, OTHER_MODULE, Category, Phase
from .figures import Breakdown, OtherParts
from .tracked import TrackedPeak


def _scaled(values: Mapping[tuple[str, Category], int], total: int) -> dict[tuple[str, Category], int]:
    """``values`` scaled to sum to ``total`` exactly (largest remainders get the leftover bytes)."""
    whole = sum(values.values())
    if whole <= 0:
        return {key: 0 for key in values}
    shares = {key: size * total / whole for key, size in values.items()}
    result = {key: int(share) for key, share in shares.items()}
    leftover = total - sum(result.values())
    for key in sorted(shares, key=lambda k: -(shares[k] - result[k]))[:leftover]:
        result[key] += 1
    return result


def _other_parts(rest: int, tracked: TrackedPeak, allocated_at_start: int | None) -> OtherParts | None:
    if allocated_at_start is None:
        return None
    outside = min(sum(size for (category, _), size in tracked.held.items() if category is Category.OTHER), rest)
    before = min(max(allocated_at_start - tracked.tracked_at_start, 0), rest - outside)
    return OtherParts(outside_models=outside, before_cell=before, unseen=rest - outside - before)


def breakdown_at_peak(
    peak_bytes: int, tracked: TrackedPeak, max_modules: int = MAX_MODULES, allocated_at_start: int | None = None
) -> Breakdown:
    """The tracker's figures made to sum to the allocator's ``peak_bytes``.

    What the tracker counted as ``Category.OTHER`` and all it did not see become one figure, the
    rest of the peak: the tracker's own "other" is tensors outside any model, which the allocator
    counts too, so counting both would count them twice. Memory a tracker cannot see (cuBLAS's
    workspace, scratch an operation frees before it returns, tensors older than the cell outside any
    model) is in that rest as well; with ``allocated_at_start`` (the allocator's figure as the cell
    started) the rest is split into ``OtherParts``. Modules beyond the ``max_modules`` largest join
    ``OTHER_MODULE``.
    """
    known: dict[tuple[str, Category], int] = {}
    for (category, module), size in tracked.held.items():
        if category is Category.OTHER or size <= 0:
            continue
        key = (module or OTHER_MODULE, category)
        known[key] = known.get(key, 0) + size
    tracked_bytes = sum(known.values())
    scaled = tracked_bytes > peak_bytes
    cells = _scaled(known, peak_bytes) if scaled else dict(known)
    rest = peak_bytes - sum(cells.values())
    cells[(OTHER_MODULE, Category.OTHER)] = cells.get((OTHER_MODULE, Category.OTHER), 0) + rest
    module_totals: dict[str, int] = {}
    for (module, _), size in cells.items():
        if module != OTHER_MODULE:
            module_totals[module] = module_totals.get(module, 0) + size
    kept = set(sorted(module_totals, key=lambda m: -module_totals[m])[:max_modules])
    folded: dict[tuple[str, Category], int] = {}
    for (module, category), size in cells.items():
        row: tuple[str, Category] = (module if module in kept else OTHER_MODULE, category)
        folded[row] = folded.get(row, 0) + size
    return Breakdown(
        device=tracked.device,
        peak_bytes=peak_bytes,
        cells=folded,
        phase=tracked.phase,
        expected=dict(tracked.expected),
        tracked_bytes=tracked_bytes,
        models=tracked.models,
        scaled=scaled,
        other_parts=_other_parts(rest, tracked, allocated_at_start),
    )


def breakdowns_for(
    peaks: Mapping[str, int], tracked: Mapping[str, TrackedPeak], allocated_at_start: Mapping[str, int] | None = None
) -> tuple[Breakdown, ...]:
    """A breakdown for each measured device (``{"cuda:0": peak bytes}``) the tracker saw; with each
    device's allocated bytes as the cell started, ``Category.OTHER`` is split into its parts.

    A tracker of one device paired with one measured device pairs them whatever their names (a tracker
    of CPU tensors standing in for a GPU in tests).
    """
    start = allocated_at_start or {}
    if len(peaks) == 1 and len(tracked) == 1:
        [(device, peak)] = peaks.items()
        [seen] = tracked.values()
        return (breakdown_at_peak(peak, seen, allocated_at_start=start.get(device)),)
    # a device the tracker saw no tensor on: all of its peak is "other"
    return tuple(
        breakdown_at_peak(peak, tracked.get(device) or TrackedPeak(device, {}, Phase.OUTSIDE),
                          allocated_at_start=start.get(device))
        for device, peak in peaks.items()
    )
