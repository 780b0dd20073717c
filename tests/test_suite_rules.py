"""Rules the test suite keeps about itself, checked by reading its source (nothing here runs a test).

- The tests' own modules (``tests/fakes.py``, ``tests/oomfix/simulated.py``, ...) are imported by one path,
  ``tests.fakes``: pytest puts each test folder on ``sys.path``, so a bare ``import fakes`` also works, and
  loads a second copy of the module beside ``tests.fakes`` (two ``FakeTensor`` classes that
  ``isinstance`` tells apart). Code that a kernel, an engine or a child process runs counts too.
- A test that runs a benchmark script's code carries the ``benchmark_smoke`` marker (``make test-fast``
  skips those).
- A test's asserts are not all behind an ``if``: a condition on the machine is a skip with a reason, so
  a run that checked nothing does not pass as one that did.
- A module marked ``dependency_free`` (``make test-min`` leaves it out) loads none of the libraries whose
  versions ``make test-min`` changes, neither when imported nor in its own import statements; while it
  runs, ``tests/conftest.py`` fails it where its fixtures or body use one (``tests/versioned.py``).
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.versioned import VERSIONED, used_during

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"


def _python_files(*folders: Path) -> list[Path]:
    """The Python files under ``folders``, this one excepted (its own examples break the rules on purpose)."""
    here = Path(__file__).resolve()
    return sorted(path for folder in folders for path in folder.rglob("*.py") if path.resolve() != here)


def _own_module_names() -> set[str]:
    """Every name a bare import of one of the tests' own modules or folders would start with."""
    names = {path.stem for path in TESTS.rglob("*.py") if path.stem != "conftest"}
    names |= {path.name for path in TESTS.rglob("*") if path.is_dir() and any(path.glob("*.py"))}
    return names - {"tests"}


def _bare_imports(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """Imports in ``tree`` (and in the code its strings hold for kernels and child processes) of ``names``."""
    found = []
    statement = re.compile(r"^\s*(?:%px\s+)?(?:from|import)\s+([A-Za-z_][\w.]*)", re.MULTILINE)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.split(".")[0] in names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in names:
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            for match in statement.finditer(node.value):
                if match.group(1).split(".")[0] in names:
                    found.append((node.lineno, f"{match.group(1)} (in a string of code)"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "__import__":
            if node.args and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).split(".")[0] in names:
                found.append((node.lineno, f"__import__({node.args[0].value!r})"))
    return sorted(found)


def test_the_tests_own_modules_are_imported_as_tests_dot_name():
    names = _own_module_names()
    assert {"fakes", "engine_fakes", "notebook_runner", "history_day", "simulated", "lab"} <= names
    bare = [
        f"{path.relative_to(REPO)}:{line}: {module}"
        for path in _python_files(TESTS, REPO / "benchmarks", REPO / "scripts")
        for line, module in _bare_imports(ast.parse(path.read_text(encoding="utf-8")), names)
    ]
    assert not bare, "import these as tests.<name> (e.g. `from tests.fakes import ...`):\n" + "\n".join(bare)


def test_the_check_sees_each_way_of_a_bare_import():
    names = {"fakes", "oomfix"}
    source = '''
import fakes
from fakes import FakeMachine
from oomfix.simulated import SimulatedCell
from tests.fakes import FakeMachine
import tests.fakes
CELL = "import os\\nfrom fakes import FakeNvml"
SETUP = "%px import fakes; machine = fakes.FakeMachine()"
nvml = __import__("fakes").FakeNvml
'''
    assert [line for line, _ in _bare_imports(ast.parse(source), names)] == [2, 3, 4, 7, 8, 9]


def _runs_benchmark_code(tree: ast.AST) -> bool:
    """Whether a test module imports from ``benchmarks`` or names a script in it as a path."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "benchmarks":
            return True
        if isinstance(node, ast.Import) and any(alias.name.split(".")[0] == "benchmarks" for alias in node.names):
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value == "benchmarks" or re.fullmatch(r"benchmarks/\w+\.py", node.value):
                return True
    return False


def _marked_benchmark_smoke(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            return any(isinstance(n, ast.Attribute) and n.attr == "benchmark_smoke" for n in ast.walk(node.value))
    return False


def test_tests_that_run_benchmark_code_carry_the_benchmark_smoke_marker():
    # tests/gpu is left out: a GPU test that borrows a benchmark's cases (test_leaks_gpu.py) tests the
    # extension on the card, and never runs in the CPU suite.
    modules = [path for path in _python_files(TESTS) if path.name.startswith("test_") and "gpu" not in path.parts]
    runs_benchmarks = [path for path in modules if _runs_benchmark_code(ast.parse(path.read_text(encoding="utf-8")))]
    assert len(runs_benchmarks) >= 7
    unmarked = [
        str(path.relative_to(REPO))
        for path in runs_benchmarks
        if not _marked_benchmark_smoke(ast.parse(path.read_text(encoding="utf-8")))
    ]
    assert not unmarked, "add `pytestmark = pytest.mark.benchmark_smoke` to:\n" + "\n".join(unmarked)


@pytest.mark.parametrize("source, marked", [
    ("import pytest\npytestmark = pytest.mark.benchmark_smoke\n", True),
    ("import pytest\npytestmark = [pytest.mark.gpu, pytest.mark.benchmark_smoke]\n", True),
    ("import pytest\npytestmark = pytest.mark.gpu\n", False),
    ("import pytest\n", False),
])
def test_the_marker_check_reads_pytestmark(source, marked):
    assert _marked_benchmark_smoke(ast.parse(source)) is marked


def _asserts(node: ast.AST, under_if: bool = False) -> list[bool]:
    """For each assert in a test's own body (not in functions it defines): whether an ``if`` holds it."""
    found = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(child, ast.Assert):
            found.append(under_if)
        found += _asserts(child, under_if or isinstance(child, ast.If))
    return found


def _tests_with_every_assert_under_an_if(tree: ast.AST) -> list[str]:
    return [
        node.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test")
        and (held := _asserts(node)) and all(held)
    ]


def test_no_test_keeps_all_its_asserts_behind_an_if():
    hidden = [
        f"{path.relative_to(REPO)}::{name}"
        for path in _python_files(TESTS)
        for name in _tests_with_every_assert_under_an_if(ast.parse(path.read_text(encoding="utf-8")))
    ]
    assert not hidden, "make the condition a skip with a reason (or drop it):\n" + "\n".join(hidden)


def test_the_if_check_tells_a_hidden_body_from_a_branch():
    source = '''
def test_hidden():
    if not cuda():
        assert a
        assert b

def test_skipped():
    if cuda():
        pytest.skip("needs no CUDA")
    assert a

def test_branch():
    assert a
    if b:
        assert c

def test_in_a_helper():
    def check():
        if a:
            assert b
    check()
'''
    assert _tests_with_every_assert_under_an_if(ast.parse(source)) == ["test_hidden"]


def _marked(tree: ast.Module, marker: str) -> bool:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            return any(isinstance(n, ast.Attribute) and n.attr == marker for n in ast.walk(node.value))
    return False


def _versioned_imports(tree: ast.AST) -> list[str]:
    """The versioned libraries that ``tree``'s import statements name, wherever they stand."""
    names = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    names += [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module]
    return sorted({name.split(".")[0] for name in names} & set(VERSIONED))


def _loaded_on_import(*modules: str) -> list[str]:
    """The versioned libraries in ``sys.modules`` after importing ``modules`` in one fresh interpreter."""
    code = (f"import importlib, json, sys; [importlib.import_module(m) for m in {list(modules)!r}]; "
            f"print(json.dumps(sorted(set(sys.modules) & set({list(VERSIONED)!r}))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_modules_left_out_of_the_minimum_versions_run_load_no_versioned_library():
    marked = [path for path in _python_files(TESTS)
              if path.name.startswith("test_") and _marked(ast.parse(path.read_text(encoding="utf-8")), "dependency_free")]
    assert marked, "no module is marked dependency_free: then `make test-min` needs no -m"
    modules = {".".join(path.relative_to(REPO).with_suffix("").parts): path for path in marked}
    # All in one interpreter: what none of them loads, no one of them loads; one by one only to name them.
    together = _loaded_on_import(*modules)
    loads = {}
    for module, path in modules.items():
        found = sorted(set(_versioned_imports(ast.parse(path.read_text(encoding="utf-8"))))
                       | (set(_loaded_on_import(module)) if together else set()))
        if found:
            loads[module] = found
    assert not loads and not together, (f"these load libraries `make test-min` checks at their minimum; drop "
                                         f"dependency_free: {loads or together}")


def test_the_dependency_check_sees_imports_anywhere_and_on_import():
    source = "import json\nfrom tests.oomfix import world\ndef test_x():\n    import numpy as np\n    from torch import nn\n"
    assert _versioned_imports(ast.parse(source)) == ["numpy", "torch"]
    assert _loaded_on_import("tests.oomfix.world") == []
    assert "IPython" in _loaded_on_import("jupyter_cudamem.magics")
    assert "IPython" in _loaded_on_import("tests.oomfix.world", "jupyter_cudamem.magics")


def test_the_watch_while_a_test_runs_sees_a_library_imported_inside_a_function():
    def pure() -> int:
        return len(json.dumps([1, 2]))

    def lazy() -> object:
        from IPython import get_ipython

        return get_ipython

    with used_during() as used:
        pure()
    assert used == set()
    with used_during() as used:
        lazy()
    assert used == {"IPython"}
    assert type(sys.modules["IPython"]).__name__ == "module"  # put back after the block
