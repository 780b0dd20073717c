"""What a Python callable keeps alive of its own, and the names it reads them by.

A function keeps its default arguments and its closure cells (``callbacks.append(lambda x, t=t: ...)``,
a nested ``def`` using a tensor of the enclosing one), a bound method its object, a ``functools.partial``
its function and arguments. The walk follows these (never a function's globals or code), and the text of
what a cell left names them (``callbacks[0].__defaults__[0]``, "keeping 1 tensor in its closure (scale)").
"""

from __future__ import annotations

import types
from enum import StrEnum
from functools import partial
from typing import Any

class Capture(StrEnum):
    """How a callable keeps a value, named in the text of what a cell left ("keeping 1 tensor in its closure")."""

    DEFAULT_ARGUMENT = "default argument"
    CLOSURE = "closure"
    BOUND_OBJECT = "bound object"
    PARTIAL_ARGUMENT = "partial argument"


# Callables that keep values alive of their own: a function (defaults, closure cells), a bound method
# (its object, its function), a ``functools.partial`` (its function and arguments).
CALLABLES_KEEPING = (types.FunctionType, types.MethodType, partial)


def function_captures(function: types.FunctionType | types.MethodType | partial[object]) -> list[tuple[str, Any]]:
    """What a Python function keeps alive of its own: its default arguments and the contents of its
    closure cells (not its globals, not its code); a bound method, its object and function; a
    ``functools.partial``, its function and arguments. Each with the expression that reads it."""
    if isinstance(function, types.MethodType):
        return [("__self__", function.__self__), ("__func__", function.__func__)]
    if isinstance(function, partial):
        arguments = [(f"args[{i}]", value) for i, value in enumerate(function.args)]
        return [("func", function.func), *arguments, *((f"keywords[{k!r}]", v) for k, v in function.keywords.items())]
    captures: list[tuple[str, Any]] = []
    for index, value in enumerate(function.__defaults__ or ()):
        captures.append((f"__defaults__[{index}]", value))
    for name, value in (function.__kwdefaults__ or {}).items():
        captures.append((f"__kwdefaults__[{name!r}]", value))
    for index, cell in enumerate(function.__closure__ or ()):
        try:
            captures.append((f"__closure__[{index}].cell_contents", cell.cell_contents))
        except ValueError:  # a cell not filled yet (the enclosing function has not bound the name)
            continue
    return captures


def capture_names(function: types.FunctionType) -> dict[str, str]:
    """The variable each of ``function_captures``' expressions reads: ``{"__defaults__[0]": "t"}``."""
    code = function.__code__
    positional = code.co_varnames[: code.co_argcount]
    defaults = function.__defaults__ or ()
    names = {f"__defaults__[{i}]": name for i, name in enumerate(positional[len(positional) - len(defaults) :])}
    names.update({f"__kwdefaults__[{name!r}]": name for name in function.__kwdefaults__ or {}})
    names.update({f"__closure__[{i}].cell_contents": name for i, name in enumerate(code.co_freevars)})
    return names
