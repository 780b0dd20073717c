"""PyTorch's caching-allocator counters: the only module that reads them.

One statistics read per sample gives allocated, reserved and both peaks together; the convenience
functions (``memory_allocated()``, ``max_memory_allocated()``...) each rebuild the whole statistics
dict, three times the cost (on an H100: 140 µs for one ``memory_stats()`` against 430 µs for
``memory_allocated()``, ``max_memory_allocated()`` and ``memory_reserved()``; benchmarks/overhead.py
measures what a measured cell costs).

Measured on an H100 (benchmarks/profile_every_cell.py): the public ``memory_stats_as_nested_dict(i)``
and ``synchronize(i)`` spend more time resolving the device index and switching device context
(~6 µs and ~20 µs) than the reads themselves (~11 µs and ~2 µs). Where this torch has the C entry
points behind them (``torch._C._cuda_memoryStats``, ``_cuda_synchronize``, since torch 1.x), we call
them directly for an integer index; otherwise the public functions.
"""

from __future__ import annotations

import gc
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..errors import CudaMemError
from .base import OPTIMIZER_STEPS, STEP_MARK_BYTES, AllocatorReading, TorchDevice

if TYPE_CHECKING:
    import torch
    from torch import Tensor
    from torch.utils.hooks import RemovableHandle


def _torch() -> ModuleType:
    if "torch" not in sys.modules:  # the first import: seconds, which a Ctrl-C must not cut
        with _interrupts_deferred():
            import torch
    import torch

    return torch


@contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """A Ctrl-C (SIGINT, as a kernel's interrupt) while the block runs is raised once it is done. An import of
    torch cut half way leaves a torch that no later ``import torch`` can finish: the kernel must be restarted."""
    interrupted: list[int] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda number, frame: interrupted.append(number))
    except (ValueError, OSError, AttributeError):  # not the main thread (or no SIGINT here): nothing to defer
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
    if interrupted:
        raise KeyboardInterrupt


def _hold_free_blocks(torch: ModuleType, index: int) -> list[Tensor]:
    """Placeholders filling every free block of this stream's large segments on device ``index``.

    Each is asked for at its block's exact size, so the allocator's best fit hands it that block (or one
    of the same size) and opens no segment; one it cannot place ends the filling."""
    stream = torch.cuda.current_stream(index).cuda_stream
    held: list[Tensor] = []
    for segment in torch.cuda.memory_snapshot():
        if (segment.get("device") != index or segment.get("segment_type") != "large"
                or segment.get("is_expandable") or segment.get("stream", 0) != stream):
            continue  # expandable segments give back their free pages: nothing to pin
        for block in segment.get("blocks", ()):
            if block.get("state") != "inactive":
                continue
            try:
                held.append(torch.empty(int(block["size"]), dtype=torch.uint8, device=f"cuda:{index}"))
            except torch.cuda.OutOfMemoryError:
                return held
    return held


def _make_workspaces(torch: ModuleType, index: int, allocated_before: int) -> None:
    """cuBLAS's workspaces made now: a matmul with bias in this thread, then (where the process had more)
    one in autograd's backward thread, which has a cuBLAS handle, so a workspace, of its own."""
    a = torch.ones(8, 8, device=f"cuda:{index}", requires_grad=True)
    with torch.enable_grad():
        out = torch.addmm(a[0], a, a)
        torch.mm(a, a)
        if torch.cuda.memory_allocated(index) < allocated_before:
            out.sum().backward()
    del a, out


def _graph_pool_bytes(torch: ModuleType, index: int) -> int:
    """What segments of private pools (CUDA graphs') hold reserved on device ``index``."""
    return sum(int(segment.get("total_size") or 0) for segment in torch.cuda.memory_snapshot()
               if segment.get("device") == index and tuple(segment.get("segment_pool_id") or (0, 0)) != (0, 0))


def _pci_bus_id(props: object) -> str | None:
    """NVML's form of the PCI address (``00000000:00:06.0``), where this torch exposes it."""
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return None
    domain = getattr(props, "pci_domain_id", 0) or 0
    device = getattr(props, "pci_device_id", 0) or 0
    return f"{int(domain):08x}:{int(bus):02x}:{int(device):02x}.0"


class TorchAllocator:
    """Reads ``torch.cuda``; never initialises CUDA just to look."""

    def __init__(self) -> None:
        self._status: str | None = None
        self._status_known = False
        self._steps: StepMarks | None = None
        self._count: int | None = None  # the device count, kept once CUDA is up (as torch keeps it)

    def status(self) -> str | None:
        if self._status_known:
            return self._status
        try:
            torch = _torch()
        except ImportError:
            self._status = "PyTorch is not installed, so allocator figures are not measured"
        except Exception as error:  # a torch left half imported (an import interrupted): the kernel needs a restart
            reason = str(error).splitlines()[0][:160] if str(error) else ""
            self._status = (f"PyTorch fails to import ({type(error).__name__}: {reason}), so allocator figures are not "
                            "measured; restart the kernel")
        else:
            if not torch.cuda.is_available():
                build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
                self._status = (
                    f"PyTorch {torch.__version__} ({build}) sees no CUDA device, "
                    "so allocator figures are not measured"
                )
            else:
                self._status = None
        self._status_known = True
        return self._status

    def is_initialized(self) -> bool:
        # Only a torch the user already imported can hold memory; importing it here would cost seconds.
        torch = sys.modules.get("torch")
        if torch is None or not hasattr(torch, "cuda"):
            return False
        try:
            return bool(torch.cuda.is_initialized())
        except Exception:  # a half-imported torch during the user's own import
            return False

    def device_count(self) -> int:
        """Asked three times a measured cell: kept once CUDA is up, when ``CUDA_VISIBLE_DEVICES`` can no longer
        change it (torch keeps it from then on too)."""
        if self._count is not None:
            return self._count
        if self.status() is not None:
            return 0
        cuda = _torch().cuda
        count = int(cuda.device_count())
        if cuda.is_initialized():
            self._count = count
        return count

    def device(self, index: int) -> TorchDevice:
        props = _torch().cuda.get_device_properties(index)
        uuid = getattr(props, "uuid", None)
        return TorchDevice(
            index=index,
            name=str(props.name),
            total_bytes=int(props.total_memory),
            uuid=None if uuid is None else str(uuid),
            pci_bus_id=_pci_bus_id(props),
        )

    def synchronize(self, index: int) -> None:
        torch = _torch()
        c_api = torch._C
        if hasattr(c_api, "_cuda_synchronize") and hasattr(c_api, "_cuda_getDevice") and c_api._cuda_getDevice() == index:
            c_api._cuda_synchronize()  # the current device: no device switch needed
        else:
            torch.cuda.synchronize(index)

    def read(self, index: int) -> AllocatorReading:
        torch = _torch()
        raw_stats = getattr(torch._C, "_cuda_memoryStats", None)
        stats = raw_stats(index) if raw_stats is not None else torch.cuda.memory_stats_as_nested_dict(index)
        try:  # every key is there in the torches we know (twice a measured cell: a third of the parse's cost)
            allocated, reserved = stats["allocated_bytes"]["all"], stats["reserved_bytes"]["all"]
            return AllocatorReading(int(allocated["current"]), int(reserved["current"]), int(allocated["peak"]),
                                    int(reserved["peak"]), int(stats["num_ooms"]), int(stats["num_alloc_retries"]))
        except KeyError:  # a torch without one of them: 0 for what it does not count
            pass
        allocated = stats.get("allocated_bytes", {}).get("all", {})
        reserved = stats.get("reserved_bytes", {}).get("all", {})
        return AllocatorReading(
            allocated_bytes=int(allocated.get("current", 0)),
            reserved_bytes=int(reserved.get("current", 0)),
            peak_allocated_bytes=int(allocated.get("peak", 0)),
            peak_reserved_bytes=int(reserved.get("peak", 0)),
            num_ooms=int(stats.get("num_ooms", 0)),
            num_alloc_retries=int(stats.get("num_alloc_retries", 0)),
        )

    def reset_peak(self, index: int) -> None:
        torch = _torch()
        raw_reset = getattr(torch._C, "_cuda_resetPeakMemoryStats", None)  # as ``read``: no device lookup
        if raw_reset is not None:
            raw_reset(index)
        else:
            torch.cuda.reset_peak_memory_stats(index)

    def empty_cache(self) -> None:
        if self.is_initialized():
            _torch().cuda.empty_cache()

    def renew_workspaces(self, index: int) -> None:
        torch = _torch()
        # Private but stable since torch 2.0 (CUDA graphs call it before a capture); absent on CPU builds.
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is None or not self.is_initialized():
            return
        with torch.cuda.device(index):
            before = torch.cuda.memory_allocated(index)
            clear()
            torch.cuda.empty_cache()
            if torch.cuda.memory_allocated(index) >= before:
                return  # none was there: the process makes them when it first needs them, as before
            # Made again now, each in a segment of its own: the free blocks of segments that live tensors
            # keep (no empty_cache() returns those) are held meanwhile, or the workspaces would be carved
            # from them and pin them after the tensors go (on an H100, notebook 04's two 32 MiB workspaces
            # kept a 944 MiB segment once its activations were deleted).
            held = _hold_free_blocks(torch, index)
            try:
                _make_workspaces(torch, index, before)
            except torch.cuda.OutOfMemoryError:
                held.clear()  # no room for a segment of their own under the cap: carved, as before
                _make_workspaces(torch, index, before)
            finally:
                held.clear()
                torch.cuda.empty_cache()
            torch.cuda.synchronize(index)

    def release_graph_pools(self, index: int) -> int:
        # Where torch.compile never loaded its graph trees, a pool is of the user's own CUDA graphs: theirs.
        if "torch._inductor.cudagraph_trees" not in sys.modules or not self.is_initialized():
            return 0
        torch = _torch()
        before = _graph_pool_bytes(torch, index)
        if not before:
            return 0
        reset = getattr(getattr(torch, "compiler", None), "reset", None) or torch._dynamo.reset
        reset()  # the trees' shutdown frees their graphs; the pools go once their tensors do
        gc.collect()
        torch.cuda.empty_cache()
        return max(before - _graph_pool_bytes(torch, index), 0)

    def memory_fraction(self, index: int) -> float | None:
        getter = getattr(_torch().cuda, "get_per_process_memory_fraction", None)
        if getter is None:
            return None
        return float(getter(index))

    def set_memory_fraction(self, index: int, fraction: float) -> None:
        _torch().cuda.set_per_process_memory_fraction(fraction, index)

    def start_trace(self, max_entries: int, stacks: bool = True, mark_steps: bool = False, join: bool = False) -> None:
        memory = _torch().cuda.memory
        if not hasattr(memory, "_record_memory_history"):
            raise CudaMemError("this PyTorch cannot record allocation history; --trace needs torch 2.1 or later")
        if not join:
            # Without stacks (context None) each event costs no Python frame walk: what %oomfix records.
            memory._record_memory_history(enabled="all", context="all" if stacks else None, stacks="python",
                                          max_entries=max_entries)
        if self._steps is not None:
            self._steps.remove()  # a recording never stopped: its hooks go, not beside the new ones
            self._steps = None
        if mark_steps:
            self._steps = StepMarks.install(_torch())

    def snapshot(self) -> dict[str, Any]:
        memory = _torch().cuda.memory
        if not hasattr(memory, "_snapshot"):
            raise CudaMemError("this PyTorch cannot take an allocator snapshot (torch 2.1 or later can)")
        return dict(memory._snapshot())

    def stop_trace(self, leave_running: bool = False) -> dict[str, Any]:
        memory = _torch().cuda.memory
        steps, self._steps = self._steps, None
        try:
            snapshot = dict(memory._snapshot())
            if steps is not None:
                snapshot[OPTIMIZER_STEPS] = list(steps.marks)
            return snapshot
        finally:
            if not leave_running:
                memory._record_memory_history(enabled=None)
            if steps is not None:
                steps.remove()


class StepMarks:
    """Marks each optimizer ``step()`` in the recorded history, so that what a step allocates can be told
    from what the batch does (a step's state and temporaries are the parameters' size at every batch).

    Global step hooks (torch 2.0+): before a step, two tensors of ``STEP_MARK_BYTES`` are made at once and
    the second freed, the first is freed after it. Each mark is ``(device, first address, second address)``. A step given a closure is not marked:
    the closure runs the forward and backward passes inside it."""

    def __init__(self, torch: ModuleType):
        self._torch = torch
        self.marks: list[tuple[int, int, int]] = []
        self._open: dict[int, Tensor] = {}
        self._handles: list[RemovableHandle] = []

    @classmethod
    def install(cls, torch: ModuleType) -> "StepMarks | None":
        hooks = sys.modules.get("torch.optim.optimizer")  # not an attribute of torch.optim in every torch
        pre = getattr(hooks, "register_optimizer_step_pre_hook", None)
        post = getattr(hooks, "register_optimizer_step_post_hook", None)
        if pre is None or post is None:
            return None
        marks = cls(torch)
        marks._handles = [pre(marks._before), post(marks._after)]
        return marks

    def _before(self, optimizer: torch.optim.Optimizer, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        try:
            given = args[1:] if args and args[0] is optimizer else args  # torch passes the step's self too
            if given or (kwargs or {}).get("closure") is not None:
                return
            device = self._device_of(optimizer)
            if device is None or device.type != "cuda":
                return
            first_bytes, second_bytes = STEP_MARK_BYTES
            first = self._torch.empty(first_bytes, dtype=self._torch.uint8, device=device)
            second = self._torch.empty(second_bytes, dtype=self._torch.uint8, device=device)
            self.marks.append((device.index or 0, first.data_ptr(), second.data_ptr()))
            self._open[id(optimizer)] = first
        except Exception:  # noqa: BLE001  a mark is never worth a user's step
            return

    @staticmethod
    def _device_of(optimizer: torch.optim.Optimizer) -> torch.device | None:
        return next((p.device for group in optimizer.param_groups for p in group["params"]), None)

    def _after(self, optimizer: object, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        self._open.pop(id(optimizer), None)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._open.clear()
