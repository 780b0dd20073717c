"""One run of a cell's source, measured: the one place where ``%oomfix``'s tries and ``%%cudamem_plan``'s
runs start the meter, time the run, record its allocations and stop the meter, so both read the same
figures the same way. An error the run raises is measured and raised again. No torch, no IPython.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..measure import Measurement, Meter

from ..growth.replay import RecordedRun
from .recording import Recorder


@dataclass(frozen=True)
class MeasuredRun:
    """What one run showed; the caller drops ``error`` once read (its frames hold the run's tensors)."""

    error: BaseException | None = field(repr=False)
    measurement: Measurement
    wall_s: float
    recorded: RecordedRun | None = field(default=None, repr=False)


def run_measured(run: Callable[[], BaseException | None], meter: Meter, recorder: Recorder | None = None,
                 device: int | None = None) -> MeasuredRun:
    """Run ``run`` between the meter's start and stop, its allocations on ``device`` recorded by
    ``recorder`` (when both are given and the recording can start)."""
    baseline = meter.start()
    recording = recorder.start(device) if recorder is not None and device is not None else None
    started = time.perf_counter()
    try:
        error = run()
    except BaseException as raised:
        if recorder is not None and device is not None:
            recorder.stop(recording, device, failed=True)  # an interrupt must not leave it recording
        with contextlib.suppress(Exception):  # a broken device must not hide the run's own error
            meter.stop(baseline, error=type(raised).__name__)
        raise
    wall_s = time.perf_counter() - started
    recorded = (recorder.stop(recording, device, failed=error is not None)
                if recorder is not None and device is not None else None)
    measurement = meter.stop(baseline, error=None if error is None else type(error).__name__)
    return MeasuredRun(error, measurement, wall_s, recorded)
