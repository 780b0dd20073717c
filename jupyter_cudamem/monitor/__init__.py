"""The live GPU monitor: a polling thread (``poller``) and views of it (``widget``).

``monitor()`` does what ``%cudamem_monitor`` does, from Python::

    from jupyter_cudamem.monitor import monitor
    monitor()                      # start, or show again, this shell's monitor
    monitor(interval_s=0.5, devices=[0])
    monitor("snapshot")            # the recorded history as a matplotlib figure
    monitor("stop")

``from jupyter_cudamem import monitor; monitor()`` works too: this module can be called.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..errors import CudaMemError

if TYPE_CHECKING:
    from .snapshot import Snapshot

__all__ = ["monitor"]


def monitor(
    action: str | None = None,
    *,
    interval_s: float | None = None,
    devices: str | Sequence[int] | None = None,
    history_s: float | None = None,
) -> Snapshot | None:
    """Start (or show again), stop, or snapshot the live GPU monitor of the current IPython shell.

    Loads the extension if needed, so the monitor shares the NVML session and the devices of
    ``%%cudamem``. ``action`` is ``None``/``"start"``, ``"stop"`` or ``"snapshot"`` (which returns a
    ``Snapshot``: ``.figure()`` is a matplotlib figure). Sizes are bytes, times seconds.
    """
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        raise CudaMemError("monitor() shows its panel in IPython or Jupyter; call it from a notebook or IPython")
    # The magics layer owns the per-shell state (one poller per shell, closed on %unload_ext);
    # this function is a front end to it, like the magic, so it imports it late.
    from ..magics import loaded
    from ..magics.monitor import CudaMemMonitor

    if loaded(shell) is None:
        shell.extension_manager.load_extension("jupyter_cudamem")
    extension = loaded(shell)
    magics = extension.get(CudaMemMonitor) if extension is not None else None
    if not isinstance(magics, CudaMemMonitor):
        raise CudaMemError("the monitor is not registered in this shell: run %load_ext jupyter_cudamem")
    return magics.run(action, interval_s=interval_s, devices=devices, history_s=history_s)


class _CallableModule(types.ModuleType):
    """Lets ``from jupyter_cudamem import monitor; monitor()`` call ``monitor()`` as well."""

    def __call__(self, *args: Any, **kwargs: Any) -> Snapshot | None:
        return monitor(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
