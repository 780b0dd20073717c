"""The shape of ``jupyter_cudamem/attribution/``: modules of one job each, small enough to read, and
imports only from rooms above it in STYLE.md's map (never the advice, the presentation or the features
that use the attribution)."""

from __future__ import annotations

from pathlib import Path

import jupyter_cudamem.attribution
from tests.layout import import_graph, too_long
import pytest

# Nothing here runs a library whose version `make test-min` changes (tests/versioned.py).
pytestmark = pytest.mark.dependency_free

ATTRIBUTION = Path(jupyter_cudamem.attribution.__file__).parent
# Rooms below attribution in the map (presentation, advice, the features, the magics): it must not import them.
FORBIDDEN = ("advice", "report", "history", "monitor", "oomfix", "capacity", "magics")


def _modules(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.py"))


def _package_of(path: Path) -> list[str]:
    """``["jupyter_cudamem", "attribution"]`` for a module of that package: what its relative imports start from."""
    parts = path.relative_to(ATTRIBUTION.parent.parent).with_suffix("").parts
    return list(parts[:-1])


def _upward_imports(folder: Path, package: list[str] | None = None) -> list[str]:
    """Each import of a room below attribution, read by the import graph's own reader (``imports``)."""
    graph = import_graph()
    problems = []
    for path in _modules(folder):
        inside = package if package is not None else _package_of(path)
        for module in graph.imports(path, inside):
            if graph.room_of(module) in FORBIDDEN:
                problems.append(f"{path.name} imports {module}")
    return sorted(problems)


def test_no_attribution_module_is_over_600_lines_nor_a_class_over_300():
    assert too_long(ATTRIBUTION) == []


def test_attribution_imports_neither_the_advice_nor_the_features():
    assert _upward_imports(ATTRIBUTION) == []


def test_the_layout_checks_catch_what_they_exist_to_catch(tmp_path):
    """The two checks above, on a package made to break them: a 601-line module, a 301-line class, and
    the imports of the advice and the features written each way Python allows."""
    (tmp_path / "long.py").write_text("x = 1\n" * 601)
    body = "".join(f"    a{index} = {index}\n" for index in range(300))
    (tmp_path / "wide.py").write_text(f"class Wide:\n{body}")  # 301 lines from ``class`` to its end
    (tmp_path / "fits.py").write_text("class Fits:\n" + body[: body.index("    a299")])  # 300 lines
    (tmp_path / "upward.py").write_text(
        "from ..advice import leak_advice\n"
        "from .. import oomfix\n"
        "import jupyter_cudamem.capacity.plan\n"
        "def late():\n"
        "    from ..magics import cudamem\n"
        "from jupyter_cudamem import report\n"
        "from ..units import MiB\n"  # above attribution in the map: allowed
        "from .walk import walk\n"
    )
    assert too_long(tmp_path) == [
        "long.py: 601 lines (at most 600)",
        "wide.py: class Wide is 301 lines (at most 300)",
    ]
    assert _upward_imports(tmp_path, ["jupyter_cudamem", "attribution"]) == [
        "upward.py imports jupyter_cudamem.advice",
        "upward.py imports jupyter_cudamem.advice.leak_advice",
        "upward.py imports jupyter_cudamem.capacity.plan",
        "upward.py imports jupyter_cudamem.magics",
        "upward.py imports jupyter_cudamem.magics.cudamem",
        "upward.py imports jupyter_cudamem.oomfix",
        "upward.py imports jupyter_cudamem.report",
    ]
