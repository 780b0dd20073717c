"""Thin IPython front ends: parse arguments, call the layers below, display.

``load`` registers every magics class of ours on a shell and ``unload`` undoes all of it: magics,
event callbacks, configurables and threads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

from ..hardware import Hardware, default_hardware
from .base import CudaMemMagicsBase

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

M = TypeVar("M", bound=CudaMemMagicsBase)


def _magic_classes() -> list[type[CudaMemMagicsBase]]:
    from .cudamem import CudaMem
    from .engines import CudaMemEngines
    from .history import CudaMemHistory
    from .monitor import CudaMemMonitor
    from .oomfix import OomFix
    from .plan import CudaMemPlan

    return [CudaMem, CudaMemHistory, CudaMemMonitor, OomFix, CudaMemPlan, CudaMemEngines]


class Extension:
    """The extension as loaded into one shell."""

    def __init__(self, shell: InteractiveShell, hardware: Hardware):
        self.shell = shell
        self.hardware = hardware
        self.magics: list[CudaMemMagicsBase] = []
        # ``%reset -f out`` leaves the last values shown alive in IPython's hidden namespace: released
        # after each cell (``ipython_state.release_flushed_underscores``).
        from ..ipython_state import release_flushed_underscores_after_cell

        self.after_cell = release_flushed_underscores_after_cell(shell)
        # PyTorch's counters as each cell starts, read once for all of ours (registered first, so they are
        # read before any measurement of ours starts).
        from .cell_starts import CellStarts

        self.cell_starts = CellStarts(shell, hardware)

    def get(self, kind: type[M]) -> M | None:
        return next((m for m in self.magics if isinstance(m, kind)), None)


_loaded: dict[int, Extension] = {}


def _configured(kind: type[M], shell: InteractiveShell, extension: Extension) -> M:
    """``kind`` with the shell's settings. A value ``%config`` refused stays in the shell's config (IPython
    keeps it), as does a bad one in ``ipython_config.py``: each is left out with one line, where it stopped
    ``%load_ext`` with a traceback."""
    from traitlets import TraitError

    from .base import note

    configurables = getattr(shell, "configurables", [])
    known = len(configurables)
    try:
        return kind(shell=shell, hardware=extension.hardware, extension=extension)
    except TraitError:
        del configurables[known:]  # IPython lists a Magics before its settings fail: %config would still set it
    settings = shell.config.pop(kind.__name__, {})
    instance = kind(shell=shell, hardware=extension.hardware, extension=extension)
    for name in [name for name in settings if name in instance.traits(config=True)]:
        try:
            setattr(instance, name, settings[name])
        except TraitError as error:
            note(f"{kind.__name__}.{name} = {str(settings.pop(name))[:40]} is left out ({error}); set it again with "
                 f"%config {kind.__name__}.{name} = ...")
    shell.config[kind.__name__] = settings
    return instance


def load(shell: InteractiveShell, hardware: Hardware | None = None) -> Extension:
    """Register our magics on ``shell``; a second load of the same shell returns the first."""
    existing = _loaded.get(id(shell))
    if existing is not None:
        return existing
    extension = Extension(shell, hardware or default_hardware())
    for kind in _magic_classes():
        instance = _configured(kind, shell, extension)
        shell.register_magics(instance)
        extension.magics.append(instance)
    shell.events.register("post_run_cell", extension.after_cell)
    _loaded[id(shell)] = extension
    return extension


def loaded(shell: InteractiveShell) -> Extension | None:
    return _loaded.get(id(shell))


def unload(shell: InteractiveShell) -> None:
    """Stop threads, drop callbacks and magics, and close NVML once nothing uses it."""
    extension = _loaded.pop(id(shell), None)
    if extension is None:
        return
    try:
        shell.events.unregister("post_run_cell", extension.after_cell)
    except ValueError:
        pass
    extension.cell_starts.close()
    registry = shell.magics_manager.magics
    for instance in extension.magics:
        instance.close()
        for kind, names in instance.magics.items():
            for name, bound in names.items():
                if registry.get(kind, {}).get(name) == bound:
                    del registry[kind][name]
        if instance in getattr(shell, "configurables", []):
            shell.configurables.remove(instance)
    if not _loaded:
        extension.hardware.nvml.close()
