"""``TorchAllocator`` on whatever torch this machine has; the GPU paths run in tests/gpu."""

import types

import pytest
import torch

from jupyter_cudamem.sources.torch_alloc import TorchAllocator, _pci_bus_id


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch sees a CUDA device: test_status_is_none_with_cuda")
def test_status_says_why_without_cuda():
    status = TorchAllocator().status()
    assert status is not None
    assert torch.__version__ in status and "sees no CUDA device" in status


@pytest.mark.gpu
def test_status_is_none_with_cuda():
    assert TorchAllocator().status() is None


def test_not_initialised_means_nothing_is_read():
    if torch.cuda.is_initialized():
        pytest.skip("an earlier test in this process initialised CUDA (the GPU suite does)")
    allocator = TorchAllocator()
    assert allocator.is_initialized() is False
    allocator.empty_cache()  # must not initialise CUDA
    assert not torch.cuda.is_initialized()


def test_pci_bus_id_in_nvml_form():
    props = types.SimpleNamespace(pci_bus_id=0x1A, pci_device_id=0, pci_domain_id=0)
    assert _pci_bus_id(props) == "00000000:1a:00.0"
    assert _pci_bus_id(types.SimpleNamespace()) is None


def test_renewing_workspaces_without_cuda_does_nothing():
    if torch.cuda.is_initialized():
        pytest.skip("an earlier test in this process initialised CUDA (the GPU suite does)")
    TorchAllocator().renew_workspaces(0)
    assert not torch.cuda.is_initialized()


def test_releasing_graph_pools_without_cuda_does_nothing():
    if torch.cuda.is_initialized():
        pytest.skip("an earlier test in this process initialised CUDA (the GPU suite does)")
    assert TorchAllocator().release_graph_pools(0) == 0
    assert not torch.cuda.is_initialized()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_pool_of_the_users_own_cuda_graph_is_left_alone():
    # Not torch.compile's: resetting the compiler would not free it, and it is the user's to keep.
    x = torch.zeros(1 << 20, device="cuda")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(2):
            y = x * 2  # warm up on the side stream, as CUDA graphs ask
        with torch.cuda.graph(graph):
            y = x * 2
    torch.cuda.current_stream().wait_stream(stream)
    pools = [s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id") or (0, 0)) != (0, 0)]
    assert pools
    assert TorchAllocator().release_graph_pools(torch.cuda.current_device()) == 0
    graph.replay()
    assert torch.equal(y, x * 2)


def cache_a_freed_gib() -> None:
    """No cuBLAS workspace, an empty cache, then a 1 GiB block freed into it: what the next request is cut from."""
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    big = torch.empty(1 << 28, device="cuda")
    del big


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run `pytest -m gpu` on a GPU machine)")
def test_renewed_workspaces_sit_in_segments_of_their_own():
    # A workspace made while a freed 1 GiB block is cached is carved from it and pins its segment.
    cache_a_freed_gib()
    a = torch.ones(64, 64, device="cuda")
    torch.mm(a, a)
    torch.addmm(a[0], a, a)
    torch.cuda.synchronize()

    def pinned() -> list[int]:
        """Segments holding a live block beside a free one of 256 MiB or more."""
        return [s["total_size"] for s in torch.cuda.memory_snapshot()
                if any(b["state"] == "active_allocated" for b in s["blocks"])
                and any(b["state"] == "inactive" and b["size"] >= 1 << 28 for b in s["blocks"])]

    torch.cuda.empty_cache()
    assert pinned(), "the workspace was not carved from the cached block: the test proves nothing here"
    allocated = torch.cuda.memory_allocated()
    TorchAllocator().renew_workspaces(torch.cuda.current_device())
    assert pinned() == []
    assert torch.cuda.memory_allocated() == allocated  # the same workspaces, made again
    del a


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run `pytest -m gpu` on a GPU machine)")
def test_renewed_workspaces_leave_the_segment_of_a_live_tensor():
    # A live tensor keeps a 1 GiB segment that no empty_cache() returns; workspaces made again with its
    # free block at hand would be carved from it and keep the segment after the tensor is gone.
    cache_a_freed_gib()
    kept = torch.empty(1 << 20, device="cuda")  # 4 MiB, cut from the cached 1 GiB block
    a = torch.ones(64, 64, device="cuda")
    torch.addmm(a[0], a, a)
    torch.cuda.synchronize()

    def beside_kept() -> list[int]:
        """Sizes of the other live blocks in the segment that holds ``kept``."""
        address = kept.data_ptr()
        for segment in torch.cuda.memory_snapshot():
            if segment["address"] <= address < segment["address"] + segment["total_size"]:
                return [b["size"] for b in segment["blocks"]
                        if b["state"] == "active_allocated" and b["address"] != address]
        raise AssertionError("no segment holds the kept tensor")

    torch.cuda.empty_cache()
    assert beside_kept(), "the workspace was not carved beside the kept tensor: the test proves nothing here"
    allocated = torch.cuda.memory_allocated()
    TorchAllocator().renew_workspaces(torch.cuda.current_device())
    assert beside_kept() == []
    assert torch.cuda.memory_allocated() == allocated  # the same workspaces, made again
    del kept, a


class _Block:
    """A tensor as the marks see it: only its address."""

    def __init__(self, address: int):
        self.address = address

    def data_ptr(self) -> int:
        return self.address


def test_each_optimizer_step_is_marked_by_a_pair_of_requests_and_the_hooks_go_with_the_recording():
    import types

    import torch

    from jupyter_cudamem.sources.base import STEP_MARK_BYTES
    from jupyter_cudamem.sources.torch_alloc import StepMarks

    made: list[int] = []
    sizes: list[int] = []

    def empty(size, **__):
        made.append(4096 * (len(made) + 1))
        sizes.append(size)
        return _Block(made[-1])

    marks = StepMarks.install(types.SimpleNamespace(empty=empty, uint8=torch.uint8))
    assert marks is not None
    marks._device_of = lambda optimizer: torch.device("cuda", 1)  # type: ignore[method-assign]
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    weight.grad = torch.ones(2)
    optimizer.step()  # through torch's own global hooks, as it calls them
    assert marks.marks == [(1, 4096, 8192)] and not marks._open  # the first lived through the step only
    assert tuple(sizes) == STEP_MARK_BYTES  # sizes no pair of other requests has
    seen_open = []
    optimizer.register_step_pre_hook(lambda *_: seen_open.append(bool(marks._open)))
    optimizer.step()
    assert seen_open == [True] and len(marks.marks) == 2
    optimizer.step(lambda: 0.0)  # a closure runs the passes inside the step: not marked
    assert len(marks.marks) == 2
    marks.remove()
    optimizer.step()
    assert len(marks.marks) == 2  # removed: no hook runs
    marks._device_of = lambda optimizer: torch.device("cpu")  # type: ignore[method-assign]
    marks._before(optimizer, (optimizer,), {})
    assert len(marks.marks) == 2  # a CPU step is not the GPU's


def test_a_mark_never_breaks_the_users_step():
    import types

    import torch

    from jupyter_cudamem.sources.torch_alloc import StepMarks

    def broken(*_, **__):
        raise RuntimeError("CUDA error: out of memory")

    marks = StepMarks(types.SimpleNamespace(optim=torch.optim, empty=broken, uint8=torch.uint8))
    on_gpu = types.SimpleNamespace(param_groups=[{"params": [types.SimpleNamespace(device=torch.device("cuda", 0))]}])
    marks._before(on_gpu, (on_gpu,), {})
    assert marks.marks == []


def test_a_recording_never_stopped_leaves_no_step_hooks_beside_the_next_ones(monkeypatch):
    import types

    from jupyter_cudamem.sources import torch_alloc

    recorded: list[dict] = []
    memory = types.SimpleNamespace(_record_memory_history=lambda **kwargs: recorded.append(kwargs))
    monkeypatch.setattr(torch_alloc, "_torch", lambda: types.SimpleNamespace(cuda=types.SimpleNamespace(memory=memory)))
    removed: list[str] = []
    installed = iter(("first", "second"))

    class Marks:
        def __init__(self):
            self.name = next(installed)

        def remove(self):
            removed.append(self.name)

    monkeypatch.setattr(torch_alloc.StepMarks, "install", classmethod(lambda cls, torch: Marks()))
    allocator = torch_alloc.TorchAllocator()
    allocator.start_trace(10, stacks=False, mark_steps=True)
    allocator.start_trace(10, stacks=False, mark_steps=True)  # the first was never stopped (an interrupt)
    assert removed == ["first"] and allocator._steps is not None and allocator._steps.name == "second"
    allocator.start_trace(10)  # no marks asked for: none left
    assert removed == ["first", "second"] and allocator._steps is None and len(recorded) == 3


def test_a_recording_joined_keeps_the_users_settings_and_keeps_running(monkeypatch):
    import types

    from jupyter_cudamem.sources import torch_alloc

    recorded: list[dict] = []
    memory = types.SimpleNamespace(_record_memory_history=lambda **kwargs: recorded.append(kwargs),
                                   _snapshot=lambda: {"segments": [], "device_traces": [[]]})
    monkeypatch.setattr(torch_alloc, "_torch", lambda: types.SimpleNamespace(cuda=types.SimpleNamespace(memory=memory)))
    removed: list[str] = []

    class Marks:
        marks = [(0, 1, 2)]

        def remove(self):
            removed.append("marks")

    monkeypatch.setattr(torch_alloc.StepMarks, "install", classmethod(lambda cls, torch: Marks()))
    allocator = torch_alloc.TorchAllocator()
    allocator.start_trace(10, stacks=False, mark_steps=True, join=True)
    snapshot = allocator.stop_trace(leave_running=True)
    assert recorded == []  # neither restarted with our settings nor stopped
    assert snapshot["optimizer_steps"] == [(0, 1, 2)] and removed == ["marks"]
    allocator.start_trace(10, stacks=False)
    allocator.stop_trace()
    assert [call.get("enabled") for call in recorded] == ["all", None]


def _stats(current: int, peak: int, **scalars: int) -> dict:
    """``torch._C._cuda_memoryStats``'s nested form: each stat by pool, and the scalar counters given."""
    pools = {pool: {"current": current, "peak": peak, "allocated": peak, "freed": peak - current}
             for pool in ("all", "small_pool", "large_pool")}
    return {"allocated_bytes": pools, "reserved_bytes": {pool: {k: 2 * v for k, v in counts.items()}
                                                          for pool, counts in pools.items()}, **scalars}


@pytest.mark.parametrize(
    ("scalars", "expected_ooms", "expected_retries"),
    [({"num_ooms": 3, "num_alloc_retries": 5}, 3, 5), ({"num_ooms": 3}, 3, 0), ({}, 0, 0)],
    ids=["every_counter", "an_older_torch_without_retries", "neither"],
)
def test_a_reading_from_the_allocators_statistics(monkeypatch, scalars, expected_ooms, expected_retries):
    monkeypatch.setattr(torch._C, "_cuda_memoryStats", lambda index: _stats(100, 300, **scalars), raising=False)
    reading = TorchAllocator().read(0)
    assert (reading.allocated_bytes, reading.reserved_bytes) == (100, 200)
    assert (reading.peak_allocated_bytes, reading.peak_reserved_bytes) == (300, 600)
    assert (reading.num_ooms, reading.num_alloc_retries) == (expected_ooms, expected_retries)


def test_the_device_count_is_kept_once_cuda_is_up(monkeypatch):
    # Before, CUDA_VISIBLE_DEVICES may still change it: asked each time.
    counts = iter([2, 3, 4, 5])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: next(counts))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    allocator = TorchAllocator()
    assert (allocator.device_count(), allocator.device_count()) == (2, 3)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert (allocator.device_count(), allocator.device_count()) == (4, 4)

