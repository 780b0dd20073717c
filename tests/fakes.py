"""Stand-ins for the hardware sources, implementing the protocols in ``jupyter_cudamem.sources``.

They model just enough behaviour for the logic above them: an allocator with current/peak counters
and a per-process cap that raises on overflow, and an NVML view whose per-device "used" follows the
allocator's reserved bytes plus a CUDA context and any memory allocated "outside PyTorch".
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from jupyter_cudamem.errors import CudaMemError
from jupyter_cudamem.sources.base import (
    AllocatorReading,
    GpuIdentity,
    NvmlMemory,
    ProcessMemory,
    TorchDevice,
)

GiB = 1024**3
MiB = 1024**2


class FakeOutOfMemoryError(RuntimeError):
    """What the fake allocator raises past its cap, worded like PyTorch's message."""


@dataclass
class FakeGpu:
    """One card. ``outside_bytes`` is memory this process holds outside PyTorch (CuPy, cuBLAS...)."""

    name: str = "Fake H100"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    pci_bus_id: str = "00000000:00:06.0"
    total_bytes: int = 80 * GiB
    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    context_bytes: int = 512 * MiB
    outside_bytes: int = 0
    other_process_bytes: int = 0
    fraction: float = 1.0
    num_ooms: int = 0
    num_alloc_retries: int = 0  # times the allocator freed its cache and retried (once before each OOM)
    has_context: bool = False
    utilization: int = 0
    # NVML's total counts memory the driver keeps for itself that PyTorch's total does not (an H100:
    # 79.65 GiB to NVML, 79.18 GiB to torch); 0 plays a card whose two totals agree.
    driver_reserved_bytes: int = 0


class FakeMachine:
    """A machine of ``FakeGpu`` cards, seen through both fake sources below."""

    def __init__(self, gpus: list[FakeGpu] | None = None, pid: int = 4242):
        self.gpus = gpus if gpus is not None else [FakeGpu()]
        self.pid = pid
        self.lock = threading.Lock()

    # Helpers tests use to play the role of user code.
    def allocate(self, index: int, size: int, slack: int = 0) -> None:
        """``slack``: bytes the allocator reserves beyond the request and cannot use for anything else
        while it lives (rounding, the free part of a segment that holds it); a cap limits reserved memory."""
        gpu = self.gpus[index]
        with self.lock:
            gpu.has_context = True
            if gpu.allocated + size + slack > gpu.fraction * gpu.total_bytes:
                gpu.num_ooms += 1
                raise FakeOutOfMemoryError(
                    f"CUDA out of memory. Tried to allocate {size / GiB:.2f} GiB. GPU {index} has a total "
                    f"capacity of {gpu.total_bytes / GiB:.2f} GiB"
                )
            gpu.allocated += size
            gpu.reserved = max(gpu.reserved, gpu.allocated + slack)
            gpu.peak_allocated = max(gpu.peak_allocated, gpu.allocated)
            gpu.peak_reserved = max(gpu.peak_reserved, gpu.reserved)

    def free(self, index: int, size: int) -> None:
        with self.lock:
            self.gpus[index].allocated -= size

    def empty_cache(self) -> None:
        with self.lock:
            for gpu in self.gpus:
                gpu.reserved = gpu.allocated


class FakeAllocator:
    """``AllocatorSource`` over a ``FakeMachine``; ``visible`` maps cuda:N to machine GPUs."""

    def __init__(
        self,
        machine: FakeMachine,
        visible: list[int] | None = None,
        status: str | None = None,
        initialized: bool = True,
        expose_uuid: bool = True,
    ):
        self.machine = machine
        self.visible = visible if visible is not None else list(range(len(machine.gpus)))
        self._status = status
        self.initialized = initialized
        self.expose_uuid = expose_uuid
        self.calls: list[str] = []
        self.trace_entries: list[dict[str, Any]] | None = None
        self.step_marks: list[tuple[int, int, int]] = []  # what StepMarks would have seen, when asked for
        self.marking_steps = False
        self.snapshot_segments: list[dict[str, Any]] = []  # what snapshot() lists as segments
        self.graph_pool_bytes = 0  # what torch.compile's CUDA graph pools hold (release_graph_pools frees it)
        self.tracing = False

    def _gpu(self, index: int) -> FakeGpu:
        if not 0 <= index < len(self.visible):
            raise ValueError(f"no such fake device {index}")
        return self.machine.gpus[self.visible[index]]

    def status(self) -> str | None:
        return self._status

    def is_initialized(self) -> bool:
        return self._status is None and self.initialized

    def device_count(self) -> int:
        return 0 if self._status else len(self.visible)

    def device(self, index: int) -> TorchDevice:
        gpu = self._gpu(index)
        uuid = gpu.uuid[len("GPU-") :] if self.expose_uuid else None
        return TorchDevice(index=index, name=gpu.name, total_bytes=gpu.total_bytes, uuid=uuid)

    def synchronize(self, index: int) -> None:
        self.calls.append(f"synchronize:{index}")

    def read(self, index: int) -> AllocatorReading:
        self.calls.append(f"read:{index}")
        gpu = self._gpu(index)
        return AllocatorReading(gpu.allocated, gpu.reserved, gpu.peak_allocated, gpu.peak_reserved, gpu.num_ooms,
                                gpu.num_alloc_retries)

    def reset_peak(self, index: int) -> None:
        self.calls.append(f"reset_peak:{index}")
        gpu = self._gpu(index)
        gpu.peak_allocated = gpu.allocated
        gpu.peak_reserved = gpu.reserved

    def empty_cache(self) -> None:
        self.machine.empty_cache()

    def renew_workspaces(self, index: int) -> None:
        self.calls.append(f"renew_workspaces:{index}")

    def release_graph_pools(self, index: int) -> int:
        self.calls.append(f"release_graph_pools:{index}")
        freed, self.graph_pool_bytes = self.graph_pool_bytes, 0
        return freed

    def memory_fraction(self, index: int) -> float | None:
        return self._gpu(index).fraction

    def set_memory_fraction(self, index: int, fraction: float) -> None:
        if not 0 <= fraction <= 1:
            raise ValueError("fraction out of range")
        self._gpu(index).fraction = fraction

    def start_trace(self, max_entries: int, stacks: bool = True, mark_steps: bool = False, join: bool = False) -> None:
        self.tracing = True
        self.trace_stacks = None if join else stacks  # joined: the recording's own settings stand
        self.marking_steps = mark_steps

    def stop_trace(self, leave_running: bool = False) -> dict[str, Any]:
        self.tracing = leave_running
        snapshot = {"segments": list(self.snapshot_segments), "device_traces": [self.trace_entries or []]}
        if self.marking_steps:
            snapshot["optimizer_steps"] = list(self.step_marks)
        return snapshot

    def snapshot(self) -> dict[str, Any]:
        return {"segments": list(self.snapshot_segments), "device_traces": [[]]}


class FakeNvml:
    """``NvmlSource`` over a ``FakeMachine``; set ``failure`` to play a machine without a driver."""

    def __init__(self, machine: FakeMachine, failure: str | None = None, processes_visible: bool = True):
        self.machine = machine
        self.failure = failure
        self.processes_visible = processes_visible
        self.calls = 0
        self.closed = False
        self.raise_next: int = 0

    def _check(self) -> None:
        self.calls += 1
        if self.failure:
            raise CudaMemError(self.failure)
        if self.raise_next > 0:
            self.raise_next -= 1
            raise CudaMemError("NVML failed: Unknown Error")

    def status(self) -> str | None:
        return self.failure

    def devices(self) -> list[GpuIdentity]:
        self._check()
        return [
            GpuIdentity(index, gpu.name, gpu.uuid, gpu.pci_bus_id, gpu.total_bytes + gpu.driver_reserved_bytes)
            for index, gpu in enumerate(self.machine.gpus)
        ]

    def _own_bytes(self, gpu: FakeGpu) -> int:
        if not gpu.has_context:
            return 0
        return gpu.context_bytes + gpu.reserved + gpu.outside_bytes

    def memory(self, nvml_index: int) -> NvmlMemory:
        self._check()
        gpu = self.machine.gpus[nvml_index]
        used = self._own_bytes(gpu) + gpu.other_process_bytes + gpu.driver_reserved_bytes
        total = gpu.total_bytes + gpu.driver_reserved_bytes
        return NvmlMemory(used_bytes=used, free_bytes=total - used, total_bytes=total)

    def processes(self, nvml_index: int) -> list[ProcessMemory] | None:
        self._check()
        if not self.processes_visible:
            return None
        gpu = self.machine.gpus[nvml_index]
        found = []
        if gpu.has_context:
            found.append(ProcessMemory(self.machine.pid, self._own_bytes(gpu)))
        if gpu.other_process_bytes:
            found.append(ProcessMemory(self.machine.pid + 1, gpu.other_process_bytes))
        return found

    def utilization_percent(self, nvml_index: int) -> int | None:
        self._check()
        return self.machine.gpus[nvml_index].utilization

    def close(self) -> None:
        self.closed = True


@dataclass
class FakeSources:
    """A machine and both sources over it, as most tests want them."""

    machine: FakeMachine = field(default_factory=FakeMachine)
    allocator: FakeAllocator = field(init=False)
    nvml: FakeNvml = field(init=False)

    def __post_init__(self) -> None:
        self.allocator = FakeAllocator(self.machine)
        self.nvml = FakeNvml(self.machine)


class FakeClock:
    """A clock tests move by hand: call it for the time, ``advance(seconds)`` to move it."""

    def __init__(self, start: float = 1_000.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FlakyNvml(FakeNvml):
    """A ``FakeNvml`` whose ``memory()`` raises the queued errors first, one per call, then answers.

    Plays an NVML failing mid-run with errors of any type (``FakeNvml.raise_next`` only raises
    ``CudaMemError``); ``delay_s`` makes every read slow, like a busy driver.
    """

    def __init__(self, machine: FakeMachine, errors: list[BaseException] | None = None, delay_s: float = 0.0):
        super().__init__(machine)
        self.errors = list(errors or [])
        self.delay_s = delay_s

    def memory(self, nvml_index: int) -> NvmlMemory:
        if self.delay_s:
            import time

            time.sleep(self.delay_s)
        if self.errors:
            self.calls += 1
            raise self.errors.pop(0)
        return super().memory(nvml_index)


# --- Tensors, modules and optimizers for %oomfix's holder finding (no torch, no CUDA) ---

import itertools as _itertools

_fake_pointers = _itertools.count(0x7F00_0000_0000, 0x10_0000)


class FakeStorage:
    """A block of device memory: what ``untyped_storage()`` returns; views share one.

    Given a ``machine``, it is allocated there on creation and freed when garbage-collected, so the
    fake allocator's counters follow the objects' lifetimes as PyTorch's follow real tensors.
    """

    def __init__(self, nbytes: int, machine: "FakeMachine | None" = None, index: int = 0):
        self._nbytes = nbytes
        self._ptr = next(_fake_pointers)
        if machine is not None:
            import weakref

            machine.allocate(index, nbytes)
            weakref.finalize(self, machine.free, index, nbytes)

    def data_ptr(self) -> int:
        return self._ptr

    def nbytes(self) -> int:
        return self._nbytes


class FakeTensor:
    """Stands in for ``torch.Tensor``: ``is_cuda``, ``untyped_storage()``, ``grad``, ``shape``, weak-referenceable.

    Like a tensor made without gradients it is a leaf with no ``grad_fn``; as on ``torch.Tensor`` these are
    attributes of the class, so code that reads them directly where the class has them reads them here too.
    """

    grad_fn = None
    is_leaf = True
    retains_grad = False
    grad: "FakeTensor | None" = None

    def __init__(self, nbytes: int = 0, *, device: str = "cuda", storage: FakeStorage | None = None,
                 grad: "FakeTensor | None" = None, machine: FakeMachine | None = None):
        self._storage = storage if storage is not None else FakeStorage(nbytes, machine)
        self.device = device
        self.grad = grad
        self.shape = (self._storage.nbytes() // 4,)
        self.dtype = "float32"

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def untyped_storage(self) -> FakeStorage:
        return self._storage

    def view(self) -> "FakeTensor":
        """Another tensor over the same storage."""
        return FakeTensor(storage=self._storage, device=self.device)


class FakeModule:
    """Stands in for ``torch.nn.Module``: named parameters, buffers and submodules as attributes."""

    def __init__(self, parameters: dict[str, FakeTensor] | None = None, buffers: dict[str, FakeTensor] | None = None,
                 **children: "FakeModule"):
        self._parameters = dict(parameters or {})
        self._buffers = dict(buffers or {})
        self._modules = dict(children)

    def parameters(self):
        yield from self._parameters.values()
        for child in self._modules.values():
            yield from child.parameters()

    def buffers(self):
        yield from self._buffers.values()
        for child in self._modules.values():
            yield from child.buffers()


class FakeOptimizer:
    """Stands in for ``torch.optim.Adam``: ``param_groups`` reference the model, ``state`` is its own."""

    def __init__(self, params):
        self.param_groups = [{"params": list(params)}]
        self.state: dict = {}

    def step(self) -> None:
        for p in self.param_groups[0]["params"]:
            size = p.untyped_storage().nbytes()
            self.state[p] = {"exp_avg": FakeTensor(size, device=p.device), "exp_avg_sq": FakeTensor(size, device=p.device)}


def fake_probe():
    """A ``TensorProbe`` recognising the fakes above."""
    from jupyter_cudamem.attribution import TensorProbe

    return TensorProbe(tensor_types=(FakeTensor,), module_types=(FakeModule,), optimizer_types=(FakeOptimizer,))


def torch_cpu_probe():
    """A ``TensorProbe`` over real PyTorch types that counts CPU tensors as device memory.

    Autograd graphs, saved tensors and module hooks are plain Python-visible structures whatever the
    device, so real CPU tensors test their walking without a GPU.
    """
    import torch

    from jupyter_cudamem.attribution import TensorProbe

    return TensorProbe(
        tensor_types=(torch.Tensor,),
        module_types=(torch.nn.Module,),
        optimizer_types=(torch.optim.Optimizer,),
        on_device=lambda tensor: tensor.device.type == "cpu",
        storage_address=getattr(torch._C, "_storage_address", None),  # as default_probe reads it
    )


class FakeMover:
    """``oomfix.leftovers``' mover over fake tensors: a device tensor goes to the host as a CPU fake of the
    same size and comes back as a device fake allocated on ``machine``; ``moved`` lists the bytes moved."""

    def __init__(self, machine):
        self.machine = machine
        self.moved = []

    def holds_gpu(self, value):
        return getattr(value, "is_cuda", False) is True

    def addresses(self, value):
        return frozenset()  # fake tensors have no addresses the fake allocator's snapshots know

    def grown(self, value, from_batch, to_batch):
        """A device fake of the difference for a fake of ``from_batch`` MiB-per-sample rows (the fakes'
        inputs are 1 MiB per sample), let go when its list is cleared."""
        if not (isinstance(value, FakeTensor) and value.is_cuda and to_batch > from_batch):
            return []
        nbytes = value.untyped_storage().nbytes()
        if nbytes != from_batch * MiB:
            return []
        import weakref

        held = [FakeTensor((to_batch - from_batch) * MiB, machine=self.machine)]
        weakref.finalize(value, held.clear)
        return [held]

    def to_host(self, value):
        if not isinstance(value, FakeTensor):
            return None
        nbytes = value.untyped_storage().nbytes()
        self.moved.append(nbytes)
        return FakeTensor(nbytes, device="cpu"), lambda: FakeTensor(nbytes, machine=self.machine)
