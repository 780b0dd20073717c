"""``sources.host``: host memory available for a copy (jupyter_cudamem/sources/host.py)."""

from __future__ import annotations

from jupyter_cudamem.sources.host import available_bytes
import pytest

# Nothing here runs a library whose version `make test-min` changes (tests/versioned.py).
pytestmark = pytest.mark.dependency_free


def test_memavailable_is_read_in_bytes(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16384000 kB\nMemFree:          1000000 kB\nMemAvailable:    8000000 kB\n")
    assert available_bytes(str(meminfo)) == 8000000 * 1024


def test_without_meminfo_the_system_says_or_none(tmp_path):
    found = available_bytes(str(tmp_path / "missing"))
    assert found is None or found > 0
