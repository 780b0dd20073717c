"""``NvmlSession``'s closing latch and its reset in a forked child (DataLoader workers fork on Linux)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from jupyter_cudamem.errors import CudaMemError
from jupyter_cudamem.sources.nvml import NvmlSession

from tests.sources.test_nvml import fake_pynvml  # noqa: F401  the fixture: a fake NVML module as ``pynvml``


def test_calls_that_come_while_closing_are_turned_away_then_it_opens_again(fake_pynvml):
    session = NvmlSession()
    session.memory(0)
    fake_pynvml.gate.clear()  # the next call stays inside NVML
    in_flight = threading.Thread(target=session.memory, args=(0,), daemon=True)
    in_flight.start()
    while session._in_flight == 0:
        time.sleep(0.001)
    closer = threading.Thread(target=session.close, daemon=True)
    closer.start()
    try:
        while not session._closing:
            time.sleep(0.001)
        with pytest.raises(CudaMemError, match="shutting down"):
            session.memory(1)
        assert "shutting down" in session.status()
        assert "shutdown" not in fake_pynvml.log  # not while a call is inside NVML
    finally:
        fake_pynvml.gate.set()
    in_flight.join(5)
    closer.join(5)
    assert fake_pynvml.log[-1] == "shutdown"
    session.memory(0)  # the next use initialises again
    assert fake_pynvml.log.count("init") == 2


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX")
def test_a_forked_child_starts_afresh_even_with_the_lock_held(fake_pynvml):
    session = NvmlSession()
    session.devices()
    assert session._ready and session._handles
    read, write = os.pipe()
    with session._condition:  # held by the parent as it forks, as the monitor thread might
        pid = os.fork()
        if pid == 0:  # the child
            try:
                fresh = not session._ready and not session._handles and session._devices is None
                free = session._condition.acquire(timeout=1)
                if free:
                    session._condition.release()
                session.memory(0)  # initialises NVML again, in the child
                again = session._ready
                os.write(write, b"ok" if (fresh and free and again) else b"no")
            finally:
                os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 2) == b"ok"
    assert session._ready  # the parent's session is untouched
