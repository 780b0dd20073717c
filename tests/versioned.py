"""The libraries whose versions ``make test-min`` changes, and a watch on what a test uses of them.

A test module marked ``dependency_free`` is left out of ``make test-min``: ``make test`` has run it, and
nothing it runs differs at the minimum versions. ``used_during`` holds it to that while it runs (its
fixtures and its body), where a check of its imports cannot see: a package function that imports torch
inside its body, a fixture that builds a shell.
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager

# What `make test-min` installs at other versions than `make test`: the declared dependencies and test extras
# (by the name they are imported by), and numpy, which matplotlib's minimum holds below 2. pytest runs every
# test, so the rest of the suite checks it at its minimum.
VERSIONED = ("torch", "IPython", "ipywidgets", "matplotlib", "pynvml", "traitlets", "nbclient", "nbformat",
             "ipykernel", "pandas", "ipyparallel", "xdist", "numpy")


class _Watched(types.ModuleType):
    """Stands in ``sys.modules`` for a loaded module: every attribute is the module's own, and reading one
    from the watching thread is noted."""

    def __init__(self, real: types.ModuleType, used: set[str], thread: int):
        super().__init__(real.__name__)
        vars(self).update(_real=real, _used=used, _thread=thread)

    def __getattr__(self, name: str) -> object:
        if threading.get_ident() == self._thread:
            self._used.add(self._real.__name__.split(".")[0])
        return getattr(self._real, name)


@contextmanager
def used_during() -> Iterator[set[str]]:
    """The versioned libraries this thread reads anything of in the block (``import torch`` in a function,
    ``torch.Tensor``, ``from IPython import get_ipython``): each of their loaded modules is swapped for a
    watched stand-in, and put back after. A library loaded for the first time in the block is used too."""
    used: set[str] = set()
    thread = threading.get_ident()
    loaded = {name: module for name, module in list(sys.modules.items())
              if module is not None and name.split(".")[0] in VERSIONED}
    sys.modules.update({name: _Watched(module, used, thread) for name, module in loaded.items()})
    try:
        yield used
    finally:
        for name, module in list(sys.modules.items()):
            if name.split(".")[0] in VERSIONED and name not in loaded:
                used.add(name.split(".")[0])
        sys.modules.update(loaded)
