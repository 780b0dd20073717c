"""A fix's tries (jupyter_cudamem/oomfix/tries.py): what a failed try leaves once its figures are read."""

from __future__ import annotations

import sys

from jupyter_cudamem.magics.oomfix_reruns import ShellReruns
from jupyter_cudamem.oomfix.cleanup import cleanup
from jupyter_cudamem.oomfix.strategies import Strategy
from jupyter_cudamem.oomfix.tries import FixTries
from tests.fakes import FakeMover, FakeTensor, GiB, MiB


def test_a_failed_tries_tensors_go_at_its_cleanup_though_its_frame_lives_on(ip, machine, hardware):
    # A try through IPython fails in a function whose frame outlives the try (held here by a list; in a
    # notebook by a reference cycle until the next collection). Reading the try's failure site reads that
    # frame's locals; the cleanup %oomfix runs after a failed try must still free the tensor the frame
    # held, without a collection (notebook 04 c20: 0.28 GiB stayed allocated after `del` of everything).
    frames = []

    def probe():
        data = FakeTensor(256 * MiB, machine=machine)  # noqa: F841  held by this frame when it fails
        frames.append(sys._getframe())
        machine.allocate(0, 100 * GiB)

    ip.user_ns["_probe"] = probe
    reruns = ShellReruns(ip)
    tries = FixTries(reruns.run_source, hardware, max_tries=3, mover=FakeMover(machine), oom_of=reruns.oom_of,
                     cleanup=lambda error: cleanup(ip, hardware, exception=error, holds_cuda=FakeMover(machine).holds_gpu))
    try:
        result = tries.run(Strategy.CLEANUP, "_probe()", "as written", device=0)
    finally:
        ip.user_ns.pop("_probe", None)
    left = hardware.allocator_readings()[0].allocated_bytes
    assert result.out_of_memory and not result.fitted and result.failed_at is not None and len(frames) == 1
    assert left == 0, f"{left / MiB:.0f} MiB still allocated after the failed try"
