"""OOM messages as users met them, across PyTorch versions and libraries, read into ``OomInfo``."""

from __future__ import annotations

import pytest

from jupyter_cudamem.oom import OomInfo, OomKind, is_cuda_oom, parse_oom

KiB, MiB, GiB = 1024, 1024**2, 1024**3

# torch 2.11 on the H100, copied from a real OOM: an allocation larger than the card.
TORCH_2_11 = (
    "CUDA out of memory. Tried to allocate 200.00 GiB. GPU 0 has a total capacity of 79.18 GiB of which "
    "78.66 GiB is free. Including non-PyTorch memory, this process has 518.00 MiB memory in use. Of the "
    "allocated memory 0 bytes is allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated. If "
    "reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to "
    "avoid fragmentation.  See documentation for Memory Management  "
    "(https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)"
)
# torch 2.11 with set_per_process_memory_fraction(0.02), copied from a real OOM: the "allowed;" clause.
TORCH_2_11_CAPPED = (
    "CUDA out of memory. Tried to allocate 512.00 MiB. GPU 0 has a total capacity of 79.18 GiB of which "
    "77.10 GiB is free. Including non-PyTorch memory, this process has 2.01 GiB memory in use. 1.58 GiB "
    "allowed; Of the allocated memory 1.50 GiB is allocated by PyTorch, and 2.00 MiB is reserved by PyTorch "
    "but unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
)
# torch 2.1 ("capacty" typo, max_split_size_mb advice), another process listed before this one.
TORCH_2_1 = (
    "CUDA out of memory. Tried to allocate 32.00 GiB. GPU 0 has a total capacty of 23.69 GiB of which "
    "14.12 GiB is free. Process 2006998 has 256.00 MiB memory in use. Including non-PyTorch memory, this "
    "process has 9.30 GiB memory in use. Of the allocated memory 9.00 GiB is allocated by PyTorch, and "
    "982.50 KiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try "
    "setting max_split_size_mb to avoid fragmentation.  See documentation for Memory Management and "
    "PYTORCH_CUDA_ALLOC_CONF"
)
# torch 2.x in a container: NVML lists host PIDs, and the per-process figure is 2**64-1 bytes.
TORCH_2_CONTAINER = (
    "CUDA out of memory. Tried to allocate 2.13 GiB. GPU 0 has a total capacity of 8.00 GiB of which "
    "6.10 GiB is free. Process 9132 has 17179869184.00 GiB memory in use. Including non-PyTorch memory, this "
    "process has 17179869184.00 GiB memory in use. 2.63 GiB allowed; Of the allocated memory 954.00 MiB is "
    "allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated."
)
# torch 2.x with CUDA graphs: allocated memory split out for private pools.
TORCH_2_PRIVATE_POOLS = (
    "CUDA out of memory. Tried to allocate 1.00 GiB. GPU 1 has a total capacity of 39.38 GiB of which "
    "512.00 MiB is free. Including non-PyTorch memory, this process has 38.85 GiB memory in use. Of the "
    "allocated memory 30.00 GiB is allocated by PyTorch, with 4.00 GiB allocated in private pools (e.g., "
    "CUDA Graphs), and 8.00 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory "
    "is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
)
# torch 1.x (1.4 to 2.0).
TORCH_1_X = (
    "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; 14.52 GiB already "
    "allocated; 3.19 MiB free; 14.75 GiB reserved in total by PyTorch)"
)
# torch 1.10+ with a cap and the max_split_size_mb advice.
TORCH_1_X_CAPPED = (
    "CUDA out of memory. Tried to allocate 37.25 GiB (GPU 0; 23.68 GiB total capacity; 192.29 MiB already "
    "allocated; 15.79 GiB free; 2.37 GiB allowed; 5.05 GiB reserved in total by PyTorch) If reserved memory "
    "is >> allocated memory try setting max_split_size_mb to avoid fragmentation.  See documentation for "
    "Memory Management and PYTORCH_CUDA_ALLOC_CONF"
)
# torch 1.0-1.3 called reserved memory "cached".
TORCH_1_0 = (
    "CUDA out of memory. Tried to allocate 2.00 MiB (GPU 0; 10.91 GiB total capacity; 10.17 GiB already "
    "allocated; 1.50 MiB free; 10.25 GiB cached)"
)
TORCH_0_4 = "cuda runtime error (2) : out of memory at /pytorch/aten/src/THC/generic/THCStorage.cu:58"
DRIVER = (
    "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some other API call, "
    "so the stacktrace below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
)
DRIVER_API = "CUDA driver error: out of memory"
CUBLAS = "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
CUBLAS_LT = (
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasLtMatmul( ltHandle, computeDesc.descriptor(), "
    "&alpha_val, mat1_ptr, Adesc.descriptor(), mat2_ptr, Bdesc.descriptor(), &beta_val, result_ptr, "
    "Cdesc.descriptor(), result_ptr, Cdesc.descriptor(), &heuristicResult.algo, workspace.mutable_data_ptr(), "
    "workspaceSize, at::cuda::getCurrentCUDAStream())`"
)
CUDNN = "cuDNN error: CUDNN_STATUS_ALLOC_FAILED"
CUDNN_FRONTEND = "cuDNN Frontend error: [cudnn_frontend] Error: out of memory while building the plan"
CUPY = "Out of memory allocating 1,073,741,824 bytes (allocated so far: 2,147,483,648 bytes)."
JAX = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17179869184 bytes."


def test_torch_2_11_message_gives_every_figure() -> None:
    info = parse_oom(TORCH_2_11)
    assert info == OomInfo(
        kind=OomKind.ALLOCATOR,
        message=TORCH_2_11,
        device_index=0,
        requested_bytes=200 * GiB,
        total_bytes=round(79.18 * GiB),
        free_bytes=round(78.66 * GiB),
        process_bytes=518 * MiB,
        allocated_bytes=0,
        reserved_unallocated_bytes=0,
    )
    assert info.exceeds_capacity
    assert not info.looks_fragmented


def test_allowed_clause_is_the_capacity() -> None:
    info = parse_oom(TORCH_2_11_CAPPED)
    assert info is not None
    assert info.allowed_bytes == round(1.58 * GiB)
    assert info.capacity_bytes == round(1.58 * GiB)
    assert info.process_bytes == round(2.01 * GiB)
    assert info.allocated_bytes == round(1.50 * GiB)
    assert info.reserved_unallocated_bytes == 2 * MiB
    assert info.requested_bytes == 512 * MiB
    assert not info.exceeds_capacity


def test_torch_2_1_typo_and_other_process() -> None:
    info = parse_oom(TORCH_2_1)
    assert info is not None and info.kind == "allocator"
    assert info.total_bytes == round(23.69 * GiB)
    assert info.free_bytes == round(14.12 * GiB)
    assert info.reserved_unallocated_bytes == round(982.5 * KiB)
    assert info.other_processes == ((2006998, 256 * MiB),)
    assert info.process_bytes == round(9.30 * GiB)


def test_nonsense_process_figure_is_dropped() -> None:
    info = parse_oom(TORCH_2_CONTAINER)
    assert info is not None
    assert info.process_bytes is None
    assert info.other_processes == ()
    assert info.allowed_bytes == round(2.63 * GiB)
    assert info.allocated_bytes == 954 * MiB


def test_private_pools_and_fragmentation() -> None:
    info = parse_oom(TORCH_2_PRIVATE_POOLS)
    assert info is not None
    assert info.device_index == 1
    assert info.private_pool_bytes == 4 * GiB
    assert info.reserved_unallocated_bytes == 8 * GiB
    assert info.reserved_bytes == 38 * GiB
    assert info.looks_fragmented  # 8 GiB cached and unused, 1 GiB asked


def test_torch_1_x_reserved_total_becomes_unallocated() -> None:
    info = parse_oom(TORCH_1_X)
    assert info is not None
    assert (info.kind, info.device_index) == ("allocator", 0)
    assert info.requested_bytes == 20 * MiB
    assert info.total_bytes == round(15.78 * GiB)
    assert info.allocated_bytes == round(14.52 * GiB)
    assert info.free_bytes == round(3.19 * MiB)
    assert info.reserved_unallocated_bytes == round(14.75 * GiB) - round(14.52 * GiB)
    assert info.allowed_bytes is None
    assert info.process_bytes is None
    # 235 MiB of slack would hold the 20 MiB request, but it is 1.5% of the card: not fragmentation.
    assert not info.looks_fragmented


def test_torch_1_x_with_cap() -> None:
    info = parse_oom(TORCH_1_X_CAPPED)
    assert info is not None
    assert info.allowed_bytes == round(2.37 * GiB)
    assert info.exceeds_capacity
    assert info.reserved_unallocated_bytes == round(5.05 * GiB) - round(192.29 * MiB)


def test_torch_1_0_cached() -> None:
    info = parse_oom(TORCH_1_0)
    assert info is not None
    assert info.reserved_unallocated_bytes == round(10.25 * GiB) - round(10.17 * GiB)
    assert info.free_bytes == round(1.5 * MiB)


@pytest.mark.parametrize(
    "text, kind",
    [
        (TORCH_0_4, "driver"),
        (DRIVER, "driver"),
        (DRIVER_API, "driver"),
        (CUBLAS, "cublas"),
        (CUBLAS_LT, "cublas"),
        (CUDNN, "cudnn"),
        (CUDNN_FRONTEND, "cudnn"),
        ("cuFFT error: CUFFT_ALLOC_FAILED", "other"),
    ],
)
def test_errors_outside_the_allocator(text: str, kind: str) -> None:
    info = parse_oom(text)
    assert info is not None
    assert info.kind == kind and info.kind is OomKind(kind)
    assert info.requested_bytes is None and info.total_bytes is None


def test_driver_message_keeps_first_lines_only() -> None:
    info = parse_oom(DRIVER)
    assert info is not None
    assert info.message.splitlines()[0] == "CUDA error: out of memory"


def test_other_libraries_sizes() -> None:
    cupy = parse_oom(CUPY)
    jax = parse_oom(JAX)
    assert cupy is not None and cupy.kind == "other"
    assert cupy.requested_bytes == 1073741824
    assert cupy.allocated_bytes == 2147483648
    assert jax is not None and jax.kind == "other"
    assert jax.requested_bytes == 17179869184


@pytest.mark.parametrize(
    "text",
    [
        "DefaultCPUAllocator: can't allocate memory: you tried to allocate 800000000000 bytes.",
        "MPS backend out of memory (MPS allocated: 9.00 GiB, other allocations: 1.00 GiB, max allowed: "
        "18.13 GiB). Tried to allocate 16.00 GiB on private pool.",
        "XPU out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 15.11 GiB of which 1.00 "
        "GiB is free.",
        "CUDA error: device-side assert triggered",
        "CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, opb, m, n, k, &alpha, a, lda, "
        "b, ldb, &beta, c, ldc)`",
        "name 'model' is not defined",
    ],
)
def test_not_a_gpu_oom(text: str) -> None:
    assert parse_oom(text) is None
    assert not is_cuda_oom(RuntimeError(text))


def test_torch_exception_types() -> None:
    torch = pytest.importorskip("torch")
    error = torch.cuda.OutOfMemoryError(TORCH_2_11_CAPPED)
    assert is_cuda_oom(error)
    info = parse_oom(error)
    assert info is not None and info.kind == "allocator"
    assert info.exception_type is not None and info.exception_type.endswith("OutOfMemoryError")
    # The class alone says allocator, whatever the wording.
    bare = parse_oom(torch.cuda.OutOfMemoryError("out of memory"))
    assert bare is not None and bare.kind == "allocator" and bare.requested_bytes is None


def test_real_cpu_allocation_failure_is_not_a_gpu_oom() -> None:
    torch = pytest.importorskip("torch")
    try:
        torch.empty(2**62, dtype=torch.uint8)
    except RuntimeError as error:
        assert not is_cuda_oom(error)
    else:  # pragma: no cover - no machine has 4 EiB
        pytest.fail("expected the CPU allocator to refuse 4 EiB")


def test_oom_re_raised_by_a_library_is_found_through_cause_and_context() -> None:
    oom = RuntimeError(TORCH_1_X)
    try:
        try:
            raise oom
        except RuntimeError as inner:
            raise ValueError("training step failed") from inner
    except ValueError as outer:
        caused = outer
    info = parse_oom(caused)
    assert info is not None and info.requested_bytes == 20 * MiB
    assert info.exception_type == "RuntimeError"

    try:
        try:
            raise RuntimeError(DRIVER)
        except RuntimeError:
            raise KeyError("cleanup in a finally block failed")  # noqa: B904 - an implicit __context__
    except KeyError as outer:
        context = outer
    assert parse_oom(context) is not None and parse_oom(context).kind == "driver"


def test_allocator_message_wins_over_a_driver_one_in_the_chain() -> None:
    outer = RuntimeError(DRIVER)
    outer.__context__ = RuntimeError(TORCH_2_11_CAPPED)
    info = parse_oom(outer)
    assert info is not None and info.kind == "allocator" and info.allowed_bytes is not None


def test_chain_with_a_cycle_and_groups_terminates() -> None:
    a = RuntimeError("first")
    b = RuntimeError("second")
    a.__context__ = b
    b.__context__ = a
    assert parse_oom(a) is None
    group = ExceptionGroup("workers failed", [ValueError("x"), RuntimeError(CUBLAS)])
    info = parse_oom(group)
    assert info is not None and info.kind == "cublas"


def test_text_in_exception_notes() -> None:
    error = RuntimeError("step 12 failed")
    error.add_note(TORCH_2_11)
    info = parse_oom(error)
    assert info is not None and info.requested_bytes == 200 * GiB


def test_none_and_non_exceptions() -> None:
    assert not is_cuda_oom(None)
    assert parse_oom(42) is None  # type: ignore[arg-type]
