"""The only code that touches hardware: PyTorch's caching allocator and NVML.

Everything above this package works with the plain readings and protocols in ``base`` so tests can
substitute the fakes in ``tests/fakes.py``.
"""

from .base import (
    AllocatorReading,
    AllocatorSource,
    GpuIdentity,
    NvmlMemory,
    NvmlSource,
    ProcessMemory,
    TorchDevice,
)

__all__ = [
    "AllocatorReading",
    "AllocatorSource",
    "GpuIdentity",
    "NvmlMemory",
    "NvmlSource",
    "ProcessMemory",
    "TorchDevice",
]
