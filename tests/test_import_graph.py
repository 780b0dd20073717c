"""The package's rooms import one way (scripts/import_graph.py): no arrow up the map, no circle between
rooms, every room on the map."""

from tests.layout import import_graph as _graph_module


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
