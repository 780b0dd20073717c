"""Plain readings and the two small interfaces that hardware adapters implement.

All sizes are bytes. A source that cannot answer says why through ``status()`` (a one-line reason,
or ``None`` when usable) instead of raising in the middle of a measurement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class AllocatorReading:
    """PyTorch caching-allocator counters for one device at one instant."""

    allocated_bytes: int
    reserved_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    num_ooms: int = 0
    num_alloc_retries: int = 0

    @property
    def reserved_unallocated_bytes(self) -> int:
        """Cached by the allocator but not holding a tensor: what ``empty_cache`` can return."""
        return max(self.reserved_bytes - self.allocated_bytes, 0)


@dataclass(frozen=True)
class TorchDevice:
    """A CUDA device as PyTorch numbers it (``cuda:N``), after ``CUDA_VISIBLE_DEVICES``."""

    index: int
    name: str
    total_bytes: int
    uuid: str | None = None
    pci_bus_id: str | None = None


@dataclass(frozen=True)
class GpuIdentity:
    """A GPU as NVML numbers it: every GPU on the machine, whatever ``CUDA_VISIBLE_DEVICES`` says."""

    nvml_index: int
    name: str
    uuid: str
    pci_bus_id: str
    total_bytes: int


@dataclass(frozen=True)
class NvmlMemory:
    """Device memory as the driver sees it, all processes and the driver's own reservation aside."""

    used_bytes: int
    free_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class ProcessMemory:
    """GPU memory NVML attributes to one process (context, allocator pools, other libraries)."""

    pid: int
    used_bytes: int | None


OPTIMIZER_STEPS = "optimizer_steps"
"""The key under which ``AllocatorSource.stop_trace`` adds the marks of the optimizer steps it saw: each
``(device, first address, second address)`` of the two requests that open a step (``STEP_MARK_BYTES``),
the first freed when the step ends (``torch_alloc.StepMarks``)."""

STEP_MARK_BYTES = (1, 3)
"""The sizes of a step mark's two requests. The allocator gives freed blocks out again, so a pair of a
mark's addresses also opens pairs of the forward pass's small tensors (on an H200 a ResNet-18 step's mark
matched two requests at the run's start, and the whole run was taken as its step); no tensor of torch's is
3 bytes made just after one of 1."""


@runtime_checkable
class AllocatorSource(Protocol):
    """PyTorch's view: exact, but blind to memory allocated outside its caching allocator."""

    def status(self) -> str | None:
        """``None`` when CUDA devices can be read, else why not (one line)."""

    def is_initialized(self) -> bool:
        """Whether this process has initialised CUDA through PyTorch (so it may hold memory)."""

    def device_count(self) -> int: ...

    def device(self, index: int) -> TorchDevice: ...

    def synchronize(self, index: int) -> None:
        """Wait for queued kernels so counters include their allocations."""

    def read(self, index: int) -> AllocatorReading: ...

    def reset_peak(self, index: int) -> None: ...

    def empty_cache(self) -> None: ...

    def renew_workspaces(self, index: int) -> None:
        """Free the cuBLAS workspaces PyTorch keeps on device ``index``, empty the cache, and make them
        again at once, so they sit in segments of their own as in a fresh process."""

    def release_graph_pools(self, index: int) -> int:
        """Reset torch.compile's CUDA graph trees (``mode="reduce-overhead"``) where their memory pools
        hold memory on device ``index``, so it goes back; the bytes freed (0: none held). A pool outlives
        the runs that filled it and serves no other allocation, and an OOM while a graph is recorded
        leaves the trees failing an assertion at the next call; reset, the next call compiles again."""

    def memory_fraction(self, index: int) -> float | None:
        """The per-process cap as a fraction of the card, or ``None`` when PyTorch cannot say."""

    def set_memory_fraction(self, index: int, fraction: float) -> None: ...

    def start_trace(self, max_entries: int, stacks: bool = True, mark_steps: bool = False, join: bool = False) -> None:
        """Start recording allocation history, with Python stacks unless ``stacks`` is false; with
        ``mark_steps``, each optimizer step is marked in it (``torch_alloc.StepMarks``); with ``join``, a
        recording someone else started goes on as they set it, and only the marks are added."""

    def stop_trace(self, leave_running: bool = False) -> dict[str, Any]:
        """Stop recording (unless ``leave_running``: a recording joined) and return the allocator snapshot
        (``torch.cuda.memory._snapshot()``), with the steps' marks under ``"optimizer_steps"`` where they
        were asked for."""

    def snapshot(self) -> dict[str, Any]:
        """The allocator snapshot now (its segments; its trace when one is being recorded)."""


@runtime_checkable
class NvmlSource(Protocol):
    """The driver's view through NVML: every allocation on the card, but no breakdown inside PyTorch."""

    def status(self) -> str | None:
        """``None`` when NVML answers, else why not (one line, with a hint)."""

    def devices(self) -> list[GpuIdentity]: ...

    def memory(self, nvml_index: int) -> NvmlMemory: ...

    def processes(self, nvml_index: int) -> list[ProcessMemory] | None:
        """Compute processes on the device, or ``None`` where NVML cannot list them."""

    def utilization_percent(self, nvml_index: int) -> int | None: ...

    def close(self) -> None:
        """Shut NVML down once no call is in flight; a later call initialises it again."""
