"""One measured run (reruns/measured.py), shared by ``%oomfix``'s tries and the plan's runs: the meter
stopped once with the run's error named, the recording stopped as failed or not, an error raised by the
run measured and raised again."""

import pytest

from jupyter_cudamem.reruns.measured import run_measured

# Nothing here runs a library whose version `make test-min` changes (tests/versioned.py).
pytestmark = pytest.mark.dependency_free


class Meter:
    def __init__(self):
        self.calls = []

    def start(self):
        self.calls.append("start")
        return "baseline"

    def stop(self, baseline, error=None):
        self.calls.append(("stop", baseline, error))
        return f"measurement ({error})"


class Recorder:
    def __init__(self, can_start=True):
        self.can_start, self.calls = can_start, []

    def start(self, device):
        self.calls.append(("start", device))
        return ("segments",) if self.can_start else None

    def stop(self, start, device, failed):
        self.calls.append(("stop", start, device, failed))
        return None if start is None else "recorded"


def test_a_run_that_returns_its_error_is_measured_and_recorded_as_failed():
    meter, recorder = Meter(), Recorder()
    error = RuntimeError("CUDA out of memory")
    run = run_measured(lambda: error, meter, recorder, device=0)
    assert run.error is error and run.measurement == "measurement (RuntimeError)" and run.recorded == "recorded"
    assert meter.calls == ["start", ("stop", "baseline", "RuntimeError")]
    assert recorder.calls == [("start", 0), ("stop", ("segments",), 0, True)]
    assert run.wall_s >= 0


def test_a_run_that_fits_is_recorded_only_with_a_recorder_and_a_device():
    meter = Meter()
    assert run_measured(lambda: None, meter).recorded is None
    recorder = Recorder()
    assert run_measured(lambda: None, Meter(), recorder, device=None).recorded is None and recorder.calls == []
    run = run_measured(lambda: None, Meter(), recorder, device=1)
    assert run.error is None and run.recorded == "recorded" and recorder.calls[-1] == ("stop", ("segments",), 1, False)


def test_an_error_the_run_raises_is_measured_and_raised_again_and_the_recording_stopped():
    meter, recorder = Meter(), Recorder()

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_measured(interrupted, meter, recorder, device=0)
    assert meter.calls == ["start", ("stop", "baseline", "KeyboardInterrupt")]
    assert recorder.calls == [("start", 0), ("stop", ("segments",), 0, True)]


def test_a_meter_that_breaks_while_stopping_does_not_hide_the_run_s_error():
    class Broken(Meter):
        def stop(self, baseline, error=None):
            raise RuntimeError("CUDA error: device-side assert")

    def fails():
        raise ValueError("the cell's own error")

    with pytest.raises(ValueError, match="the cell's own error"):
        run_measured(fails, Broken())
