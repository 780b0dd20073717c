"""A cell parsed once, whoever reads it (jupyter_cudamem/cell/source.py: ``parse_cell``'s memo)."""

from __future__ import annotations

import ast
import dataclasses
from functools import lru_cache

import pytest

from jupyter_cudamem.cell import source as cell_source
from jupyter_cudamem.cell.source import default_transform, parse_cell

SOURCE = "batch = 8\nx = make(batch)\n"


@pytest.fixture
def parses(monkeypatch):
    """A fresh memo for this test, and the texts ``ast.parse`` is called on."""
    memo = cell_source._parse
    monkeypatch.setattr(cell_source, "_parse", lru_cache(maxsize=memo.cache_info().maxsize)(memo.__wrapped__))
    texts: list[str] = []
    real = ast.parse

    def parse(text, *args, **kwargs):
        texts.append(text)
        return real(text, *args, **kwargs)

    monkeypatch.setattr(ast, "parse", parse)
    return texts


def test_a_source_read_again_is_not_parsed_again(parses):
    first = parse_cell(SOURCE)
    assert parse_cell(SOURCE) is first and parse_cell(SOURCE, default_transform) is first  # None is IPython's
    assert parses == [SOURCE]


def test_the_bound_methods_of_one_object_share_an_entry_and_another_objects_do_not(parses):
    class Shell:
        def __init__(self, name: str):
            self.name = name

        def transform_cell(self, text: str) -> str:
            return text.replace("make", self.name)

    shell, other = Shell("build"), Shell("load")
    assert shell.transform_cell is not shell.transform_cell  # a new bound method at each access
    first = parse_cell(SOURCE, shell.transform_cell)
    assert parse_cell(SOURCE, shell.transform_cell) is first
    assert ast.unparse(first.tree).endswith("x = build(batch)")
    assert ast.unparse(parse_cell(SOURCE, other.transform_cell).tree).endswith("x = load(batch)")
    assert len(parses) == 2


def test_a_new_closure_is_a_new_entry_never_another_transforms_tree(parses):
    def renaming(name: str):
        return lambda text: text.replace("make", name)

    for name in ("build", "load", "build"):
        assert ast.unparse(parse_cell(SOURCE, renaming(name)).tree).endswith(f"x = {name}(batch)")
    assert len(parses) == 3  # each closure is its own key, even one that transforms as an earlier one did


def test_a_source_that_does_not_parse_raises_each_time(parses):
    for _ in range(2):
        with pytest.raises(SyntaxError):
            parse_cell("def f(:\n")
    assert parses == ["def f(:\n", "def f(:\n"]


def test_the_shared_parsed_cell_cannot_be_changed_in_place():
    parsed = parse_cell("%%time\nbatch = 8\n")
    with pytest.raises(dataclasses.FrozenInstanceError):
        parsed.header_lines = 0  # type: ignore[misc]
    with pytest.raises(TypeError):
        parsed.line_map[1] = 5  # type: ignore[index]
    assert parsed.transformed_lines == ("batch = 8\n",) and dict(parsed.line_map) == {1: 2}
