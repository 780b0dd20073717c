"""The plain-text side of our result objects, for terminal IPython and ``print``, and how a report shows
its lead and keeps the rest for who asks (``--verbose`` in text, a disclosure in HTML)."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from IPython.lib.pretty import PrettyPrinter


class TextReport:
    """Shows ``text()`` as the object's repr and as IPython's text/plain (``_repr_pretty_``).

    Rich frontends use the class's ``_repr_html_``; terminals and logs get this text. Dataclasses
    that mix it in pass ``repr=False`` so the generated field-by-field repr does not replace it.
    """

    def text(self) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, printer: PrettyPrinter, cycle: bool) -> None:
        printer.text(f"{type(self).__name__}(...)" if cycle else self.text())


def more_line(hidden: str, configurable: str) -> str:
    """The line under a report's lead that names what ``--verbose`` (or ``configurable.verbose``) adds."""
    return f"({hidden}: --verbose, or %config {configurable}.verbose = True)"


def disclosure_html(summary: str, body: str, open_: bool) -> str:
    """``body`` behind a ``<details>`` whose ``summary`` (escaped here) shows; open where verbose was asked."""
    return f"<details{' open' if open_ else ''}><summary>{html.escape(summary)}</summary>{body}</details>"
