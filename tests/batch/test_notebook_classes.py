"""What a notebook class keeps from its constructor, and which locals only rename a path."""

from __future__ import annotations

import ast

from jupyter_cudamem.batch.notebook_classes import kept_parameters, local_aliases


def class_of(source: str) -> ast.ClassDef:
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.ClassDef)
    return node


def test_kept_parameters_are_plain_stores_of_the_parameter_itself():
    definition = class_of(
        "class Loader:\n"
        "    def __init__(this, data, B, T=64, *, shuffle=True):\n"
        "        this.data, this.B = data, B\n"
        "        this.T = T * 2\n"  # a computed value is not the parameter kept
        "        this.batch = B\n"
        "        if shuffle:\n"
        "            this.order = shuffle\n"
    )
    assert kept_parameters(definition) == {"data": ["data"], "B": ["B", "batch"], "shuffle": ["order"]}


def test_a_class_without_init_keeps_nothing():
    assert kept_parameters(class_of("class C:\n    size = 4\n")) == {}


def test_local_aliases_are_locals_bound_once_to_a_path():
    body = ast.parse(
        "B, T = self.B, self.T\n"
        "n = self.sizes['n']\n"
        "i = self.start\n"
        "i += 1\n"  # bound twice: its own value
        "for k in self.keys:\n"
        "    pass\n"
        "k2 = self.items[idx]\n"  # a computed key is not a path
        "def inner():\n"
        "    m = self.M\n"  # another scope
    ).body
    assert [(name, ast.unparse(value)) for name, value in local_aliases(body)] == [
        ("B", "self.B"),
        ("T", "self.T"),
        ("n", "self.sizes['n']"),
    ]
