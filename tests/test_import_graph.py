"""The package's rooms import one way (scripts/import_graph.py): no arrow up the map, no circle between
rooms, every room on the map, and no circle between the modules of one folder."""

from tests.layout import import_graph as _graph_module
import pytest

# Nothing here runs a library whose version `make test-min` changes (tests/versioned.py).
pytestmark = pytest.mark.dependency_free

# Circles inside a folder that issue 43 is cutting on other branches: a circle not listed here fails, and an
# entry goes once its circle is cut.
BEING_CUT: list[list[str]] = []


def test_no_room_imports_one_above_it_and_no_rooms_import_each_other():
    graph = _graph_module()
    arrows = graph.graph()
    assert graph.unknown(arrows) == set()
    assert graph.upward(arrows) == []
    assert graph.circles(arrows) == []


def test_the_check_sees_an_arrow_up_and_a_circle():
    graph = _graph_module()
    arrows = {"growth": {"units"}, "units": {"growth"}, "cell": {"magics"}}
    assert graph.upward(arrows) == [("cell", "magics"), ("units", "growth")]
    assert graph.circles(arrows) == [["growth", "units"]]
    assert graph.unknown({"newroom": {"units"}}) == {"newroom"}


def test_no_two_modules_of_a_folder_import_each_other():
    graph = _graph_module()
    assert [circle for circle in graph.circles(graph.module_graph()) if circle not in BEING_CUT] == []


def test_the_folder_check_sees_a_circle_however_it_is_imported(tmp_path):
    """A made-up package: ``a`` -> ``b`` (relative), ``b`` -> ``c`` (inside a function), ``c`` -> ``a``
    (``from . import``, absolute); ``d`` imports ``a`` and nothing imports ``d``; ``__init__`` imports all,
    and ``other/e`` imports ``fold.a`` from another folder: neither is a circle inside a folder."""
    fold = tmp_path / "jupyter_cudamem" / "fold"
    other = tmp_path / "jupyter_cudamem" / "other"
    fold.mkdir(parents=True)
    other.mkdir()
    (fold / "__init__.py").write_text("from . import a, b, c, d\n")
    (fold / "a.py").write_text("from .b import B\n")
    (fold / "b.py").write_text("def late():\n    from .c import C\n")
    (fold / "c.py").write_text("from jupyter_cudamem.fold import a\n")
    (fold / "d.py").write_text("from .a import A\n")
    (other / "e.py").write_text("from ..fold.a import A\n")
    (other / "f.py").write_text("from ..fold import d\n")
    graph = _graph_module()
    arrows = graph.module_graph(tmp_path / "jupyter_cudamem")
    assert graph.circles(arrows) == [["jupyter_cudamem.fold.a", "jupyter_cudamem.fold.b", "jupyter_cudamem.fold.c"]]
    assert arrows["jupyter_cudamem.fold.d"] == {"jupyter_cudamem.fold.a"}
    assert "jupyter_cudamem.other.e" not in arrows and "jupyter_cudamem.other.f" not in arrows
