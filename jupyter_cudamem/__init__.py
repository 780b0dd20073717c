"""jupyter-cudamem: see and fix CUDA memory from inside Jupyter.

``%load_ext jupyter_cudamem`` registers ``%%cudamem``, ``%cudamem_history``, the live monitor and
``%oomfix``; ``%unload_ext jupyter_cudamem`` removes them and stops every thread they started.
"""

from __future__ import annotations

from typing import Any

from .errors import CudaMemError
from .units import format_bytes, parse_size

__version__ = "0.1.0"
__all__ = ["CudaMemError", "format_bytes", "parse_size", "load_ipython_extension", "unload_ipython_extension"]


def load_ipython_extension(ipython: Any) -> None:
    from .magics import load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    from .magics import unload

    unload(ipython)
