"""The host's memory: how much a copy made now could take without pushing the kernel into swap."""

from __future__ import annotations

import os

from ..units import KiB


def available_bytes(meminfo_path: str = "/proc/meminfo") -> int | None:
    """Bytes of host memory available to a new allocation, ``None`` where this system does not say.

    Linux's ``MemAvailable`` counts the page cache the kernel would give back, which free pages alone
    (``os.sysconf``'s ``SC_AVPHYS_PAGES``) do not; the latter is the fallback elsewhere.
    """
    try:
        with open(meminfo_path, encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    value, unit = line.split()[1:3]
                    return int(value) * (KiB if unit.lower() == "kb" else 1)
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None
