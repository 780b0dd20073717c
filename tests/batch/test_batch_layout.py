"""The batch package stays in rooms a reader can hold: no module over 600 lines, no class over 300.

Counted with ``ast``: a module by its lines, a class from its ``class`` line to its last line
(``lineno`` to ``end_lineno``, decorators not counted).
"""

import ast
from pathlib import Path

import jupyter_cudamem.batch

MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 300
BATCH = Path(jupyter_cudamem.batch.__file__).parent


def modules() -> list[Path]:
    found = sorted(BATCH.glob("**/*.py"))
    assert len(found) > 5, f"no modules found in {BATCH}"
    return found


def test_no_module_in_batch_is_over_600_lines():
    long = {}
    for path in modules():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_MODULE_LINES:
            long[path.relative_to(BATCH).as_posix()] = lines
    assert long == {}


def test_no_class_in_batch_is_over_300_lines():
    long = {}
    for path in modules():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    long[f"{path.relative_to(BATCH).as_posix()}:{node.name}"] = lines
    assert long == {}
