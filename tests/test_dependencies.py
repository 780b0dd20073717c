"""What the installed dependencies must offer; run by `make test-min` at the minimums pyproject.toml declares.

The rest of the suite exercises ipython, ipywidgets, matplotlib and traitlets directly; nvidia-ml-py needs a
driver to answer, so here we check that the installed module has every name our NVML source calls.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import jupyter_cudamem.sources.nvml as nvml_source

ROOT = Path(__file__).resolve().parent.parent


def _pynvml_names_used() -> set[str]:
    """Attributes read as ``pynvml.X`` (or ``self._pynvml.X``) in sources/nvml.py."""
    tree = ast.parse(Path(nvml_source.__file__).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owner = node.value
            owner_name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", None)
            if owner_name in ("pynvml", "_pynvml"):
                names.add(node.attr)
    return names


def test_installed_nvidia_ml_py_has_what_our_nvml_source_calls(monkeypatch):
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    import pynvml  # the real module from nvidia-ml-py, whatever version this environment has

    used = _pynvml_names_used()
    assert {"nvmlInit", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetComputeRunningProcesses"} <= used
    assert sorted(name for name in used if not hasattr(pynvml, name)) == []


def test_without_a_driver_the_real_library_gives_our_one_line_reason(monkeypatch):
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    session = nvml_source.NvmlSession()
    try:
        status = session.status()
    finally:
        session.close()
    if status is None:
        pytest.skip("an NVIDIA driver is present: NVML initialised")
    # The error classes of this nvidia-ml-py are the ones our source recognises: a known reason in one line,
    # not the generic "NVML failed: ..." it falls back to.
    assert "\n" not in status and not status.startswith("NVML failed")


def test_declared_minimums_are_pinnable():
    """Every requirement has a '>=' minimum that `make test-min` turns into an exact pin."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import min_constraints
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    pins = min_constraints.minimum_pins(ROOT / "pyproject.toml", ["test"])
    assert {"torch", "ipython", "ipywidgets", "matplotlib", "nvidia-ml-py", "traitlets", "pandas"} <= set(pins)
    assert all(version[0].isdigit() for version in pins.values())
    overridden = min_constraints.apply_overrides(pins, ["torch==2.13.0"])
    assert overridden["torch"] == "2.13.0" and overridden["matplotlib"] == pins["matplotlib"]
