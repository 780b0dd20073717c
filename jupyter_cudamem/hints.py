"""One-line advice drawn from a measurement, where the numbers make it clear."""

from __future__ import annotations

from .attribution.left import DEFAULT_THRESHOLD_BYTES
from .measure import DeviceMeasurement, Measurement
from .units import format_bytes

GiB = 1024**3
CACHED_GROWTH_HINT_BYTES = 1 * GiB
# Where %%cudamem names who holds what a cell left; the hint stands in for that report where none was made.
LEFT_ALLOCATED_HINT_BYTES = DEFAULT_THRESHOLD_BYTES
OUTSIDE_PYTORCH_HINT_BYTES = 256 * 1024**2
NEAR_FULL_FRACTION = 0.85


def device_hints(measured: DeviceMeasurement, left_attributed: bool = False) -> list[str]:
    """Hints for one device, most useful first; ``left_attributed`` when the report names who holds
    what the cell left (then the left-allocated hint would only repeat it)."""
    hints: list[str] = []
    allocated = measured.allocated_delta_bytes or 0
    reserved = measured.reserved_delta_bytes or 0
    total = measured.total_bytes
    peak = measured.peak_allocated_bytes
    if peak is not None and total and peak / total >= NEAR_FULL_FRACTION:
        hints.append(f"peak is {peak / total:.0%} of the card: close to out of memory")
    if reserved - allocated >= CACHED_GROWTH_HINT_BYTES:
        hints.append(
            f"reserved grew {format_bytes(reserved - allocated)} more than allocated: cached blocks "
            "PyTorch keeps for reuse; torch.cuda.empty_cache() returns them to the driver"
        )
    if allocated >= LEFT_ALLOCATED_HINT_BYTES and not left_attributed:
        hints.append(
            f"the cell left {format_bytes(allocated)} allocated: tensors still referenced by variables, autograd "
            "graphs, module hooks or Out[...]; %%cudamem names who holds it past "
            "%config CudaMem.attribute_threshold"
        )
    outside = measured.outside_pytorch_delta_bytes
    if outside is not None and outside >= OUTSIDE_PYTORCH_HINT_BYTES:
        first_use = measured.before.allocator is not None and measured.before.allocator.reserved_bytes == 0
        cause = "the CUDA context created on first use, " if first_use and measured.before.process_bytes == 0 else ""
        hints.append(
            f"{format_bytes(outside)} more in use outside PyTorch's allocator ({cause}cuBLAS/cuDNN workspaces, "
            "CuPy, JAX or other libraries)"
        )
    before, after = measured.before.allocator, measured.after.allocator
    if before is not None and after is not None and after.num_alloc_retries > before.num_alloc_retries:
        hints.append(
            f"the allocator had to free its cache and retry {after.num_alloc_retries - before.num_alloc_retries} "
            "time(s): memory pressure or fragmentation; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True may help"
        )
    if not measured.peak_is_block_peak:
        hints.append("peak counters were not reset (reset_peak is off): peak is since the last reset, not this cell's")
    return hints


def measurement_hints(measurement: Measurement, left_attributed: bool = False) -> list[str]:
    hints: list[str] = []
    if measurement.error in ("OutOfMemoryError", "OutOfMemory"):
        hints.append("the cell ran out of GPU memory: run %oomfix in the next cell to diagnose and fix it")
    for device in measurement.devices:
        prefix = f"{device.device.label}: " if len(measurement.devices) > 1 else ""
        hints.extend(prefix + hint for hint in device_hints(device, left_attributed))
    return hints
