"""One notion of "a GPU" for the whole extension: PyTorch's ``cuda:N`` matched to NVML's device.

NVML numbers every GPU on the machine in PCI order; PyTorch numbers only the visible ones, in
CUDA's order, after ``CUDA_VISIBLE_DEVICES``. Indexes therefore disagree (``CUDA_VISIBLE_DEVICES=1``
makes NVML's GPU 1 PyTorch's ``cuda:0``), so devices are matched by UUID, then by PCI bus id, and only
as a last resort by position.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import CudaMemError
from .sources.base import AllocatorSource, GpuIdentity, NvmlSource, TorchDevice
from .units import whole_number


@dataclass(frozen=True)
class Device:
    """A GPU this process can use, with both numberings (either may be ``None``)."""

    torch_index: int | None
    nvml_index: int | None
    name: str
    uuid: str | None
    total_bytes: int

    @property
    def label(self) -> str:
        if self.torch_index is not None:
            return f"cuda:{self.torch_index}"
        return f"GPU {self.nvml_index}"


def normalize_uuid(uuid: str | None) -> str | None:
    """NVML writes ``GPU-8f4a...``, PyTorch ``8f4a...``: compare without prefix and case."""
    if not uuid:
        return None
    text = uuid.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            text = text[len(prefix) :]
    return text


def _normalize_bus(bus_id: str | None) -> str | None:
    if not bus_id:
        return None
    parts = bus_id.strip().lower().split(":")
    # NVML may write the domain with 4 or 8 digits; compare on its value.
    if len(parts) == 3:
        return f"{int(parts[0], 16):08x}:{parts[1]}:{parts[2]}"
    return bus_id.strip().lower()


def visible_gpus(gpus: list[GpuIdentity], cuda_visible_devices: str | None) -> list[GpuIdentity]:
    """The NVML devices CUDA will show, in CUDA's order, read from ``CUDA_VISIBLE_DEVICES``.

    Used before PyTorch has initialised CUDA (asking it would create a context). Like CUDA, an
    unknown entry ends the list. Ordinals assume PCI order, as NVML numbers devices.
    """
    if cuda_visible_devices is None:
        return list(gpus)
    chosen: list[GpuIdentity] = []
    for token in cuda_visible_devices.split(","):
        token = token.strip()
        if not token:
            break
        match: GpuIdentity | None = None
        number = whole_number(token.removeprefix("-"))
        if number is not None:
            ordinal = -number if token.startswith("-") else number
            match = next((gpu for gpu in gpus if gpu.nvml_index == ordinal), None)
        else:
            wanted = normalize_uuid(token)
            match = next(
                (gpu for gpu in gpus if wanted and (normalize_uuid(gpu.uuid) or "").startswith(wanted)), None
            )
        if match is None or match in chosen:
            break
        chosen.append(match)
    return chosen


def match_devices(
    torch_devices: list[TorchDevice], gpus: list[GpuIdentity], cuda_visible_devices: str | None
) -> list[Device]:
    """Pair each PyTorch device with its NVML device: UUID, then PCI bus id, then position."""
    by_position = visible_gpus(gpus, cuda_visible_devices)
    result = []
    for torch_device in torch_devices:
        gpu = next(
            (g for g in gpus if torch_device.uuid and normalize_uuid(g.uuid) == normalize_uuid(torch_device.uuid)),
            None,
        )
        if gpu is None and torch_device.pci_bus_id:
            gpu = next((g for g in gpus if _normalize_bus(g.pci_bus_id) == _normalize_bus(torch_device.pci_bus_id)), None)
        if gpu is None and torch_device.uuid is None and torch_device.pci_bus_id is None:
            if torch_device.index < len(by_position):
                gpu = by_position[torch_device.index]
        result.append(
            Device(
                torch_index=torch_device.index,
                nvml_index=None if gpu is None else gpu.nvml_index,
                name=torch_device.name,
                uuid=torch_device.uuid or (gpu.uuid if gpu else None),
                total_bytes=torch_device.total_bytes,
            )
        )
    return result


class DeviceMap:
    """The devices of this process, resolved through both sources and cached once final.

    Until PyTorch has initialised CUDA we do not ask it (that would create a ~500 MiB context);
    the NVML devices named by ``CUDA_VISIBLE_DEVICES`` stand in, and the map is rebuilt later.
    """

    def __init__(self, allocator: AllocatorSource, nvml: NvmlSource, environ: dict[str, str] | None = None):
        self.allocator = allocator
        self.nvml = nvml
        self._environ = os.environ if environ is None else environ
        self._final: list[Device] | None = None

    def _gpus(self) -> list[GpuIdentity]:
        if self.nvml.status() is not None:
            return []
        try:
            return self.nvml.devices()
        except CudaMemError:
            return []

    def devices(self) -> list[Device]:
        if self._final is not None:
            return list(self._final)
        gpus = self._gpus()
        visible = self._environ.get("CUDA_VISIBLE_DEVICES")
        if self.allocator.is_initialized() and self.allocator.status() is None:
            torch_devices = [self.allocator.device(i) for i in range(self.allocator.device_count())]
            self._final = match_devices(torch_devices, gpus, visible)
            return list(self._final)
        return [
            Device(torch_index=None, nvml_index=g.nvml_index, name=g.name, uuid=g.uuid, total_bytes=g.total_bytes)
            for g in visible_gpus(gpus, visible)
        ]

    def torch_device_count(self) -> int:
        """How many ``cuda:N`` exist, without initialising CUDA (``device_count`` does not)."""
        if self.allocator.status() is not None:
            return 0
        return self.allocator.device_count()

    def forget(self) -> None:
        self._final = None
