"""NVTX ranges around measured cells, so an Nsight Systems timeline shows which cell ran when.

Imported only when ``%%cudamem --nvtx`` (or ``CudaMem.nvtx``) is on: with it off nothing here runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import CudaMemError

MAX_NAME_CHARS = 120
"""A range's name: ``In[12]: `` and the cell's first line, cut here (Nsight shows one line per range)."""


def range_name(count: int | None, source: str) -> str:
    """``In[12]: model.train()``: the cell's number and its first non-blank line."""
    first = next((line.strip() for line in source.splitlines() if line.strip()), "")
    name = f"In[{count if count is not None else '?'}]: {first}".rstrip(": ")
    return name if len(name) <= MAX_NAME_CHARS else name[: MAX_NAME_CHARS - 1] + "…"


class TorchNvtx:
    """PyTorch's NVTX bindings (``torch.cuda.nvtx``)."""

    def status(self) -> str | None:
        """``None`` when ranges can be pushed, else why not (one line)."""
        try:
            import torch
        except ImportError:
            return "PyTorch is not installed"
        if not torch.cuda.is_available():
            return f"PyTorch {torch.__version__} sees no CUDA device"
        return None

    @contextmanager
    def range(self, name: str) -> Iterator[None]:
        reason = self.status()
        if reason is not None:
            raise CudaMemError(f"--nvtx needs PyTorch with a CUDA device: {reason}")
        import torch

        torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            torch.cuda.nvtx.range_pop()
