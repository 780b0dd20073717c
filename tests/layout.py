"""Rooms a reader can hold: no module over 600 lines, no class over 300 (``tests/test_package_layout.py``,
``tests/attribution/test_attribution_layout.py``; its self-test breaks both limits on purpose).

Counted with ``ast``: a module by its lines, a class from its ``class`` line to its last line
(``lineno`` to ``end_lineno``, decorators not counted).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from types import ModuleType

MODULE_LINES = 600
CLASS_LINES = 300
IMPORT_GRAPH = Path(__file__).resolve().parents[1] / "scripts" / "import_graph.py"


def import_graph() -> ModuleType:
    """``scripts/import_graph.py`` (a script, not a package module): the one reader of a file's imports."""
    spec = importlib.util.spec_from_file_location("import_graph", IMPORT_GRAPH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def too_long(folder: Path) -> list[str]:
    """What in ``folder`` passes the limits, one line each (empty: nothing)."""
    problems = []
    for path in sorted(folder.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines = len(text.splitlines())
        if lines > MODULE_LINES:
            problems.append(f"{path.name}: {lines} lines (at most {MODULE_LINES})")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                length = node.end_lineno - node.lineno + 1
                if length > CLASS_LINES:
                    problems.append(f"{path.name}: class {node.name} is {length} lines (at most {CLASS_LINES})")
    return problems
