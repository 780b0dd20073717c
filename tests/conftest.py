"""Shared fixtures: a fake machine, hardware over it, and a real IPython shell with the extension."""

from __future__ import annotations

import collections
import gc
import os

# One thread for torch's CPU kernels, here and in every kernel, engine and script a test starts: the suite
# runs one process per core (pytest-xdist), and OpenMP's threads, spinning for a core another process
# holds, make torch's small CPU steps several times slower. Set before anything imports torch; a value
# already in the environment wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

from jupyter_cudamem import magics
from jupyter_cudamem.hardware import Hardware

from tests.fakes import FakeAllocator, FakeMachine, FakeNvml
from tests.versioned import used_during


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _dependency_free_held(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _dependency_free_held(item)


def _dependency_free_held(item):
    """A test marked ``dependency_free`` (``make test-min`` leaves it out) fails if its fixtures or its body
    use a library whose version ``make test-min`` changes (``tests/versioned.py``)."""
    if item.get_closest_marker("dependency_free") is None:
        yield
        return
    with used_during() as used:
        yield
    if used:
        pytest.fail(f"marked dependency_free but uses {', '.join(sorted(used))}: drop the marker, so that "
                    "`make test-min` runs it on the minimum versions", pytrace=False)


LONGEST_FIRST = ("tests/oomfix/test_simulator.py", "tests/browser/test_frontends.py")
"""Files started first (``pytest_configure``): the simulator's 10,000 models, over half the suite's CPU, and
the browser's four tests, 40 s that mostly wait on a Jupyter server and Chromium, which handed out last (by
their count of tests) ended the run alone on one worker."""


def pytest_configure(config):
    """Files in the order ``pytest_collection_modifyitems`` leaves them, for pytest-xdist to hand out. Why:
    its ``--dist loadfile`` hands out the files with the most tests first, so the simulator's four tests
    came late, and the rest of the suite could not fill the other core while it finished."""
    if getattr(config.option, "loadscopereorder", None):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """``LONGEST_FIRST``, then the other files with the most tests first, as pytest-xdist would order them;
    and GPU tests need a CUDA device: skip them with a reason where none is visible."""
    files = collections.Counter(item.nodeid.split("::", 1)[0] for item in items)
    place = {name: (name not in LONGEST_FIRST, -count, index) for index, (name, count) in enumerate(files.items())}
    items.sort(key=lambda item: place[item.nodeid.split("::", 1)[0]])
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:  # torch missing or broken: no GPU either way
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _earlier_modules_frozen() -> None:
    """Each test module starts with what earlier modules left (torch, IPython, pandas, the shell) frozen.

    ``%oomfix``, the plan and the cleanup call ``gc.collect()`` several times a rerun, and a full collection
    walks every object the process holds: by the capacity tests, some 400,000 (0.3 s a call here), so late
    tests ran three to five times slower inside the suite than alone. ``gc.freeze()`` moves what survives a
    collection now out of the collector's walk; objects a test makes are collected as before, and the package
    asks the collector nothing else (no ``get_objects``/``get_referrers``, which skip frozen objects).
    """
    gc.collect()
    gc.freeze()


@pytest.fixture
def machine() -> FakeMachine:
    return FakeMachine()


@pytest.fixture
def hardware(machine: FakeMachine) -> Hardware:
    return Hardware(allocator=FakeAllocator(machine), nvml=FakeNvml(machine), pid=machine.pid, pid_exists=lambda pid: True)


@pytest.fixture
def ip():
    """The process-wide test shell (IPython allows one InteractiveShell instance)."""
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.testing.globalipapp import get_ipython, start_ipython

    if InteractiveShell.initialized():  # some test module made the singleton already: share it
        shell = InteractiveShell.instance()
    else:
        shell = start_ipython() or get_ipython()
    yield shell
    magics.unload(shell)


@pytest.fixture
def shell(ip, hardware: Hardware, machine: FakeMachine):
    """A real shell with the extension loaded over fake hardware, ``m`` bound to the fake machine."""
    magics.unload(ip)
    magics.load(ip, hardware)
    ip.user_ns["m"] = machine
    ip.user_ns["GiB"] = 1024**3
    for name in ("_", "__", "___"):  # IPython stops setting these once a cell binds one: none carries over
        ip.user_ns.pop(name, None)
    yield ip
    magics.unload(ip)
    ip.user_ns.pop("m", None)
    for name in list(ip.config):  # %config in one test must not leak into the next
        if name.startswith(("CudaMem", "OomFix")):
            del ip.config[name]
