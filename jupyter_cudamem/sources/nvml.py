"""NVML through nvidia-ml-py: the only module that imports ``pynvml``.

One ``NvmlSession`` is shared by ``%%cudamem`` and the monitor thread. It initialises NVML lazily
under a lock, turns NVML's exceptions into one-line reasons, and on ``close()`` waits for calls in
flight before ``nvmlShutdown()``: shutting down while another thread is inside NVML is a
use-after-free that can take the interpreter down. While it closes, a latch turns new calls away
(they would make the wait endless, or run into the shutdown), and a forked child (DataLoader workers
fork on Linux) starts from a fresh session: the parent's lock may be held by a thread that does not
exist in the child, and its handles belong to the parent's initialisation.
"""

from __future__ import annotations

import os
import threading
import weakref
from types import ModuleType, TracebackType
from typing import Any, Literal

from ..errors import CudaMemError
from .base import GpuIdentity, NvmlMemory, ProcessMemory

# NVML reports "not available" per-process memory as the largest unsigned 64-bit value.
_NOT_AVAILABLE = (1 << 64) - 1
_CLOSE_WAIT_S = 5.0


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _reason(error: BaseException, pynvml: ModuleType | None) -> str:
    """A one-line explanation, with what to do, for an NVML failure."""
    if pynvml is None:
        return "nvidia-ml-py is not installed, so driver-level memory is not measured: pip install nvidia-ml-py"
    known = {
        "NVMLError_LibraryNotFound": "NVML library (libnvidia-ml.so) not found: no NVIDIA driver on this machine",
        "NVMLError_DriverNotLoaded": "the NVIDIA driver is not loaded: no GPU is usable here",
        "NVMLError_NoPermission": "NVML refused access (no permission to the GPU device files)",
        "NVMLError_LibRmVersionMismatch": "the NVIDIA driver and its library disagree in version: reboot or reload the driver",
    }
    for name, message in known.items():
        kind = getattr(pynvml, name, None)
        if kind is not None and isinstance(error, kind):
            return message
    return f"NVML failed: {error}"


class _Call:
    """``with session._call as pynvml:``: one NVML call in flight, its errors made one line.

    A class rather than ``@contextmanager``: the generator version cost as much as the NVML call
    itself on the H100, and ``memory()`` runs on every measured cell and every monitor tick.
    """

    __slots__ = ("_session",)

    def __init__(self, session: NvmlSession) -> None:
        self._session = session

    def __enter__(self) -> ModuleType:
        return self._session._enter()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> Literal[False]:
        self._session._exit(error)  # raises the translated error for an NVML failure
        return False


class NvmlSession:
    """The process-wide NVML connection; thread-safe, lazily initialised, safe to close."""

    def __init__(self) -> None:
        self._call = _Call(self)
        self._fresh()
        _sessions.add(self)

    def _fresh(self) -> None:
        """The state of a session that has not initialised NVML (new, or in a forked child)."""
        self._condition = threading.Condition(threading.Lock())
        self._in_flight = 0
        self._closing = False  # the latch: set while close() waits and shuts down
        self._ready = False
        self._failure: str | None = None
        self._pynvml: Any = None
        self._handles: dict[int, object] = {}
        self._devices: list[GpuIdentity] | None = None
        self._memory_v2: bool | None = None  # unknown until the first call

    # -- lifecycle -------------------------------------------------------------------------
    def _initialise_locked(self) -> None:
        if self._ready or self._failure is not None:
            return
        try:
            import pynvml  # the module nvidia-ml-py installs
        except ImportError as error:
            self._failure = _reason(error, None)
            return
        self._pynvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as error:
            self._failure = _reason(error, pynvml)
            return
        except OSError as error:  # some platforms raise this when the shared library is absent
            self._failure = f"NVML could not be loaded: {error}"
            return
        self._ready = True

    def _enter(self) -> ModuleType:
        """Count a call in flight (``close`` waits for it) and return the pynvml module."""
        with self._condition:
            if self._closing:
                raise CudaMemError("NVML is shutting down (the extension is being unloaded)")
            if not self._ready:
                self._initialise_locked()
                if not self._ready:
                    raise CudaMemError(self._failure or "NVML is not available")
            self._in_flight += 1
            return self._pynvml

    def _exit(self, error: BaseException | None) -> None:
        with self._condition:
            self._in_flight -= 1
            # Only close() waits, and only once it has set _closing under this lock: a call ending earlier
            # leaves it nothing to wake (it reads the count before waiting). Twice a measured cell, so skipped.
            if self._closing:
                self._condition.notify_all()
        if error is not None:
            nvml_error = getattr(self._pynvml, "NVMLError", None)
            if nvml_error is not None and isinstance(error, nvml_error):
                raise CudaMemError(_reason(error, self._pynvml)) from error

    def close(self) -> None:
        """Wait for calls in flight (new ones are turned away meanwhile), shut NVML down, and leave
        the session ready to initialise again on its next use."""
        with self._condition:
            self._closing = True
            try:
                self._condition.wait_for(lambda: self._in_flight == 0, timeout=_CLOSE_WAIT_S)
                if self._ready and self._in_flight == 0:
                    try:
                        self._pynvml.nvmlShutdown()
                    except Exception:  # already shut down elsewhere: nothing left to release
                        pass
                self._ready = False
                self._failure = None
                self._handles.clear()
                self._devices = None
                self._memory_v2 = None
            finally:
                self._closing = False

    # -- queries ---------------------------------------------------------------------------
    def status(self) -> str | None:
        if self._ready and not self._closing:  # the common case, read without the lock: a stale
            return None  # answer only delays an error to the call itself
        with self._condition:
            if self._closing:
                return "NVML is shutting down (the extension is being unloaded)"
            self._initialise_locked()
            return None if self._ready else self._failure

    def _handle(self, pynvml: ModuleType, nvml_index: int) -> object:
        handle = self._handles.get(nvml_index)
        if handle is None:
            handle = pynvml.nvmlDeviceGetHandleByIndex(nvml_index)
            self._handles[nvml_index] = handle
        return handle

    def devices(self) -> list[GpuIdentity]:
        if self._devices is not None:
            return list(self._devices)
        found = []
        with self._call as pynvml:
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = self._handle(pynvml, index)
                found.append(
                    GpuIdentity(
                        nvml_index=index,
                        name=_text(pynvml.nvmlDeviceGetName(handle)),
                        uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                        pci_bus_id=_text(pynvml.nvmlDeviceGetPciInfo(handle).busId),
                        total_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                    )
                )
        self._devices = found
        return list(found)

    def memory(self, nvml_index: int) -> NvmlMemory:
        with self._call as pynvml:
            handle = self._handle(pynvml, nvml_index)
            # v2 separates the driver's own reservation from "used"; older drivers only know v1.
            info = None
            if self._memory_v2 is not False:
                try:
                    info = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
                    self._memory_v2 = True
                except (AttributeError, TypeError):
                    self._memory_v2 = False  # this nvidia-ml-py predates v2
                except pynvml.NVMLError:
                    if self._memory_v2:
                        raise  # v2 worked before: a real error, not a reason to mix v1 and v2 figures
                    self._memory_v2 = False  # this driver does not know v2
            if info is None:
                info = pynvml.nvmlDeviceGetMemoryInfo(handle)
            return NvmlMemory(int(info.used), int(info.free), int(info.total))

    def processes(self, nvml_index: int) -> list[ProcessMemory] | None:
        with self._call as pynvml:
            handle = self._handle(pynvml, nvml_index)
            try:
                running = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            except pynvml.NVMLError:
                return None
            result = []
            for process in running:
                used = process.usedGpuMemory
                if used is None or int(used) >= _NOT_AVAILABLE:
                    used = None
                result.append(ProcessMemory(pid=int(process.pid), used_bytes=None if used is None else int(used)))
            return result

    def utilization_percent(self, nvml_index: int) -> int | None:
        with self._call as pynvml:
            handle = self._handle(pynvml, nvml_index)
            try:
                return int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except pynvml.NVMLError:
                return None


_shared_session: NvmlSession | None = None
_shared_lock = threading.Lock()
_sessions: weakref.WeakSet[NvmlSession] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A forked child starts every session afresh: no lock held by a parent's thread, no parent handles.

    NVML itself is initialised again on the child's first call; nothing is shut down here, since
    the parent still uses its own initialisation.
    """
    global _shared_lock
    _shared_lock = threading.Lock()
    for session in list(_sessions):
        session._fresh()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)


def shared_session() -> NvmlSession:
    """The one NVML session of this process, shared by measurements and the monitor."""
    global _shared_session
    with _shared_lock:
        if _shared_session is None:
            _shared_session = NvmlSession()
        return _shared_session
