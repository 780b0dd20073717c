"""How ``%%cudamem`` and ``%cudamem`` read their option line: the statement split off the line form, ``{x}``
expanded in the options only, the options parsed (memoised), and the ``--limit`` a cell's header asked for."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from ..errors import CudaMemError
from ..units import parse_size
from .options import OptionSplitter, expand_options, given_values, split_line

_MEMOISED_LINES = 256


class CudaMemArguments:
    """The option line of ``%%cudamem``, read with the magic's own ``parser`` (from ``@magic_arguments``)."""

    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser
        self._splitter = OptionSplitter(parser)
        self._parsed: dict[str, argparse.Namespace] = {}

    def split(self, line: str) -> tuple[str, str]:
        """``%cudamem -o x = f()``'s line as its options and the statement that follows them."""
        return self._splitter.split(line)

    def parse(self, line: str, namespace: Mapping[str, object], line_form: bool = False) -> argparse.Namespace:
        """The options of ``line``, ``{x}`` and ``$x`` expanded from ``namespace``; argparse's errors are its own,
        but for an option it does not know. That one is refused, where ``%time -x`` runs ``-x``, so that a
        mistyped option never runs as code; the line form's error says how a statement starting with ``-`` is
        written."""
        parsed, unknown = self._parse(expand_options(line, namespace))
        if unknown:
            listed = f"unrecognized arguments: {' '.join(unknown)}; %{'' if line_form else '%'}cudamem? lists the options"
            if line_form:
                listed += f", and a statement that starts with '-' goes in parentheses: %cudamem ({unknown[0]})"
            raise CudaMemError(listed)
        return parsed

    def limit_of(self, source: str, namespace: Mapping[str, object]) -> int | None:
        """The ``--limit`` (bytes) a ``%%cudamem`` or ``%cudamem`` cell ran under; ``None`` for any other
        cell, or one whose options do not parse."""
        text = source.lstrip()
        if text.startswith("%%cudamem"):
            line = text[len("%%cudamem"):].split("\n", 1)[0]
        elif text.startswith("%cudamem ") and "\n" not in text.strip():
            line, _ = self.split(text[len("%cudamem"):].strip())
        else:
            return None
        try:
            args = self.parse(line.strip(), namespace)
            return parse_size(args.limit) if args.limit else None
        except (CudaMemError, Exception):  # noqa: BLE001  a header argparse rejects ran no cell
            return None

    def _parse(self, line: str) -> tuple[argparse.Namespace, list[str]]:
        """The options and what the parser does not know; argparse costs ~80 µs a call, and the same option
        line always parses the same way."""
        cached = self._parsed.get(line)
        if cached is None:
            argv = split_line(line)
            parsed, unknown = self.parser.parse_known_args(argv)
            if unknown:
                return parsed, unknown
            given_values(self.parser, parsed, argv)
            cached = parsed
            if len(self._parsed) < _MEMOISED_LINES:
                self._parsed[line] = cached
        return argparse.Namespace(**vars(cached)), []
