"""jupyter-cudamem: see and fix CUDA memory from inside Jupyter.

``%load_ext jupyter_cudamem`` registers ``%%cudamem``, ``%cudamem_history``, the live monitor, ``%cudamem_engines`` and
``%oomfix``; ``%unload_ext jupyter_cudamem`` removes them and stops every thread they started.
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Any

from .errors import CudaMemError
from .units import format_bytes, parse_size

__version__ = "0.1.0"
__all__ = [
    "CudaMemError",
    "format_bytes",
    "parse_size",
    "load_ipython_extension",
    "unload_ipython_extension",
    "monitor",
]


def load_ipython_extension(ipython: InteractiveShell) -> None:
    from .magics import load

    load(ipython)


def unload_ipython_extension(ipython: InteractiveShell) -> None:
    from .magics import unload

    unload(ipython)


class _CallableMonitor(types.ModuleType):
    """``from jupyter_cudamem import monitor; monitor()``: the ``monitor`` package, callable.

    The name is the subpackage's (Python sets it on import), so the call is given to the subpackage
    here, at the top, where the magics are known; the monitor package itself stays free of them.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Snapshot | None:
        from .magics.monitor import call_monitor

        return call_monitor(*args, **kwargs)


from . import monitor  # noqa: E402 - after the names above; a light package (its modules load on use)

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

    from .monitor.snapshot import Snapshot

monitor.__class__ = _CallableMonitor

