"""The plain-text side of our result objects, for terminal IPython and ``print``."""

from __future__ import annotations

from typing import Any


class TextReport:
    """Shows ``text()`` as the object's repr and as IPython's text/plain (``_repr_pretty_``).

    Rich frontends use the class's ``_repr_html_``; terminals and logs get this text. Dataclasses
    that mix it in pass ``repr=False`` so the generated field-by-field repr does not replace it.
    """

    def text(self) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(f"{type(self).__name__}(...)" if cycle else self.text())
