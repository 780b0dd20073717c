"""One read of the selected devices through the shared ``Hardware``: NVML's used, total and
utilisation, and this process's share where NVML can map processes. Raises what NVML raises; the
poller decides what a failure means."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..errors import CudaMemError
from ..hardware import Device, Hardware
from .state import Sample

PROCESS_NOT_AVAILABLE = "per-process memory not available here"
NOT_IN_NVML = "not found among NVML's devices, so not monitored"

Reading = tuple[Device, Sample | None, str | None]
"""A device, its sample (``None`` where it cannot be read) and a remark on it."""


def selected(devices: list[Device], selection: Sequence[int] | None) -> list[Device]:
    """The devices at these ``cuda:N`` positions (those that exist); ``None`` selects them all."""
    if selection is None:
        return devices
    return [devices[i] for i in selection if 0 <= i < len(devices)]


def read_devices(hardware: Hardware, selection: Sequence[int] | None, clock: Callable[[], float]) -> list[Reading]:
    """Read every selected device once, each sample stamped by ``clock``."""
    nvml = hardware.nvml
    readings: list[Reading] = []
    for device in selected(hardware.device_map.devices(), selection):
        index = device.nvml_index
        if index is None:
            readings.append((device, None, NOT_IN_NVML))
            continue
        memory = nvml.memory(index)
        own = hardware.own_process_bytes(index, memory.used_bytes)  # reused while "used" stands
        utilization = nvml.utilization_percent(index)
        sample = Sample(
            time_s=clock(),
            used_bytes=memory.used_bytes,
            total_bytes=memory.total_bytes,
            process_bytes=own,
            utilization_percent=utilization,
        )
        readings.append((device, sample, PROCESS_NOT_AVAILABLE if own is None else None))
    return readings


def describe_error(error: BaseException) -> str:
    """A failed read as the state shows it: our own message as it is, anything else with its type."""
    if isinstance(error, CudaMemError):
        return str(error)
    return f"{type(error).__name__}: {error}"
