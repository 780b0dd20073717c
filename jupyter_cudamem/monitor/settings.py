"""The monitor's timing settings: their defaults, their bounds, and the one check of them that every
front end (``Poller``, ``%cudamem_monitor``, ``monitor()``) makes, naming each setting as it spells it."""

from __future__ import annotations

import math
from collections.abc import Mapping

from ..errors import CudaMemError
from ..units import as_float, shown_number

DEFAULT_INTERVAL_S = 1.0
DEFAULT_HISTORY_S = 300.0
DEFAULT_MAX_UPDATES_PER_S = 4.0
MIN_INTERVAL_S = 0.05
# A live view that reads less than once an hour shows nothing live; longer waits also overflow
# ``threading.Event.wait`` on some platforms (1e10 s does), which would kill the thread.
MAX_INTERVAL_S = 3600.0
# A monitor may be left running for days; this caps the memory its history can take
# (a sample is ~100 bytes, so 100k samples are ~10 MB per device).
MAX_SAMPLES_PER_DEVICE = 100_000
MAX_BACKOFF_S = 30.0

OWN_NAMES = {"interval_s": "interval_s", "history_s": "history_s", "max_updates_per_s": "max_updates_per_s"}
"""The settings as ``Poller`` spells them; a front end passes its own spelling (``--interval``) instead."""


def validate_settings(
    interval_s: float,
    history_s: float,
    max_updates_per_s: float = DEFAULT_MAX_UPDATES_PER_S,
    names: Mapping[str, str] = OWN_NAMES,
) -> None:
    """Raise ``CudaMemError`` with what to do when the settings make no sense, each setting named as
    ``names`` spells it (so an error names what the user typed). An int past a float's range (``10**400``,
    from ``monitor(history_s=...)``) is refused as an infinity is."""
    interval, history, updates = as_float(interval_s), as_float(history_s), as_float(max_updates_per_s)
    if not math.isfinite(interval) or not MIN_INTERVAL_S <= interval <= MAX_INTERVAL_S:
        raise CudaMemError(
            f"{names['interval_s']} takes seconds between readings, at least {MIN_INTERVAL_S} and at most "
            f"{MAX_INTERVAL_S:g}; got {shown_number(interval_s)} (for example 0.5)"
        )
    if not math.isfinite(history) or history <= 0:
        raise CudaMemError(
            f"{names['history_s']} takes a positive number of seconds of history; got {shown_number(history_s)} "
            "(for example 600)"
        )
    if history / interval > MAX_SAMPLES_PER_DEVICE:
        raise CudaMemError(
            f"{names['history_s']} {history:g} at {names['interval_s']} {interval:g} keeps more than "
            f"{MAX_SAMPLES_PER_DEVICE} samples per device; raise the interval or shorten the history"
        )
    if not math.isfinite(updates) or updates <= 0:
        raise CudaMemError(f"{names['max_updates_per_s']} takes a positive number; got {shown_number(max_updates_per_s)}")


def history_length(interval_s: float, history_s: float) -> int:
    """Samples kept per device: ``history_s`` of them at ``interval_s``, at least two, at most the cap."""
    return min(max(math.ceil(history_s / interval_s) + 1, 2), MAX_SAMPLES_PER_DEVICE)
