"""The plain records an engine sends to the client: sizes in bytes, nothing but numbers and text.

They cross a process (and often a host) boundary through ipyparallel's pickling, so they hold no tensor,
no device handle and no reference to the engine's history; a client unpickles them with this package alone.
A device is named by its UUID and the engine's host, never by ``cuda:N``: two engines on one host may both
call different cards ``cuda:0`` (each with its own ``CUDA_VISIBLE_DEVICES``), and two engines on one card
are told apart by their process ids and NVML's per-process figures.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..history import CellRecord
from ..measure import DeviceMeasurement


@dataclass(frozen=True)
class EngineIdentity:
    """Where an engine runs: its host, its process, and its rank where ``torch.distributed`` is up."""

    host: str
    pid: int
    rank: int | None = None
    world_size: int | None = None


@dataclass(frozen=True)
class EngineDevice:
    """One device over one measured cell on one engine (as ``%%cudamem`` reported it there)."""

    uuid: str | None
    name: str
    label: str  # the engine's own cuda:N
    total_bytes: int
    limit_bytes: int  # what the engine's PyTorch may hold there: its per-process cap, else the card
    peak_allocated_bytes: int | None
    peak_above_start_bytes: int | None
    allocated_delta_bytes: int | None
    reserved_delta_bytes: int | None
    nvml_used_delta_bytes: int | None
    process_bytes: int | None  # NVML's figure for the engine's process at the end of the cell
    process_delta_bytes: int | None
    outside_pytorch_delta_bytes: int | None

    @classmethod
    def of(cls, device: DeviceMeasurement) -> EngineDevice:
        return cls(
            uuid=device.device.uuid,
            name=device.device.name,
            label=device.device.label,
            total_bytes=device.total_bytes,
            limit_bytes=device.limit_bytes,
            peak_allocated_bytes=device.peak_allocated_bytes,
            peak_above_start_bytes=device.peak_above_start_bytes,
            allocated_delta_bytes=device.allocated_delta_bytes,
            reserved_delta_bytes=device.reserved_delta_bytes,
            nvml_used_delta_bytes=device.nvml_used_delta_bytes,
            process_bytes=device.after.process_bytes,
            process_delta_bytes=device.process_delta_bytes,
            outside_pytorch_delta_bytes=device.outside_pytorch_delta_bytes,
        )


@dataclass(frozen=True)
class EngineCell:
    """One cell measured on an engine: its number there (``In[N]`` of the engine), its first line, its devices."""

    execution_count: int | None
    source_head: str
    finished_at: float
    wall_s: float
    error: str | None
    devices: tuple[EngineDevice, ...]

    @classmethod
    def of(cls, record: CellRecord) -> EngineCell:
        measurement = record.measurement
        return cls(
            execution_count=record.execution_count,
            source_head=record.source_head,
            finished_at=record.finished_at,
            wall_s=measurement.wall_s,
            error=measurement.error,
            devices=tuple(EngineDevice.of(device) for device in measurement.devices),
        )

    @property
    def label(self) -> str:
        return f"[{self.execution_count}]" if self.execution_count is not None else "[?]"

    @property
    def peak_allocated_bytes(self) -> int | None:
        peaks = [d.peak_allocated_bytes for d in self.devices if d.peak_allocated_bytes is not None]
        return max(peaks) if peaks else None


@dataclass(frozen=True)
class OomfixSummary:
    """What the engine's last ``%oomfix`` did, in a few plain fields (its whole outcome stays on the engine)."""

    headline: str
    fitted: bool
    dry_run: bool
    strategy: str | None
    batch_before: int | None
    batch_after: int | None
    reruns: int
    diff: str


@dataclass(frozen=True)
class EngineReport:
    """Everything an engine answers: who it is, whether the extension is loaded there, its measured cells
    (the latest last; as many as were asked for) and its last ``%oomfix``."""

    identity: EngineIdentity
    loaded: bool
    cells: tuple[EngineCell, ...] = ()
    cells_recorded: int = 0  # how many cells the engine's history holds, of which ``cells`` are the latest
    oomfix: OomfixSummary | None = None
    unavailable: tuple[str, ...] = ()  # what the engine cannot measure, one line each

    @property
    def latest(self) -> EngineCell | None:
        return self.cells[-1] if self.cells else None


class EngineStatus(enum.Enum):
    """How an engine answered the client."""

    ANSWERED = "answered"
    NOT_LOADED = "extension not loaded"  # it answered, but %load_ext jupyter_cudamem never ran there
    NO_ANSWER = "no answer"  # still busy, or hung, when the client stopped waiting
    GONE = "gone"  # no longer registered with the controller (it died or was stopped)
    FAILED = "failed"  # the request raised on the engine


@dataclass(frozen=True)
class EngineAnswer:
    """One engine as the client saw it: its id, how it answered, and its report when it did."""

    engine_id: int
    status: EngineStatus
    report: EngineReport | None = None
    note: str = ""  # the error, or how long the client waited

    @property
    def latest(self) -> EngineCell | None:
        return None if self.report is None else self.report.latest


def this_engine() -> EngineIdentity:
    """The identity of the process this runs in (an engine, when shipped there by the client)."""
    import os
    import socket

    from ..sources.distributed import current_rank

    rank = current_rank()
    return EngineIdentity(
        host=socket.gethostname(),
        pid=os.getpid(),
        rank=None if rank is None else rank.rank,
        world_size=None if rank is None else rank.world_size,
    )
