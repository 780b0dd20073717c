"""What the magics' options and settings accept: the one way an option line is split and parsed, splitting a
line magic's options from the statement that follows them, expanding ``{x}``/``$x`` in the options only, and
checking a ``%config`` setting when it is set."""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Callable, Mapping
from typing import Any

from IPython.core.error import UsageError
import traitlets
from traitlets import TraitError

from ..errors import CudaMemError
from ..units import MAX_COUNT, parse_size, shown_number, whole_number

_OPTION = re.compile(r"\s*(--?[A-Za-z][\w-]*)")
_OPTION_VALUE = re.compile(r"""(?:=|\s+)("[^"]*"|'[^']*'|\S+)""")
# A value no option of ours refuses (none has ``choices``): what ``takes_value`` offers an option.
_PROBE_VALUE = "0"


def split_line(line: str) -> list[str]:
    """An option line split as a shell splits it: quotes removed (``--cards "RTX 4090"`` is one value, ``RTX
    4090``), backslashes kept (a Windows path stays as typed). IPython's own split keeps the quotes."""
    lexer = shlex.shlex(line, posix=True)
    lexer.whitespace_split = True
    lexer.escape = ""
    lexer.commenters = ""
    try:
        return list(lexer)
    except ValueError:  # shlex's "No closing quotation"
        raise UsageError(f"a quote is not closed in {line.strip()!r}: close it, or quote the value with the other quote") from None


def parse_line(magic: Callable[..., Any], line: str) -> argparse.Namespace:
    """``line`` parsed by ``magic``'s own parser (from ``@magic_arguments``), split by ``split_line``: the one
    path every magic of ours reads its options by. The parser's errors are IPython's one-line ``UsageError``."""
    parser: argparse.ArgumentParser = getattr(magic, "parser")
    argv = split_line(line)
    return given_values(parser, parser.parse_args(argv), argv)


def given_values(parser: argparse.ArgumentParser, parsed: argparse.Namespace, argv: list[str]) -> argparse.Namespace:
    """``parsed``, where every option typed has a value. Python 3.11's argparse reads ``--save=--`` (and
    ``-s--``) as the option given an empty list, which no ``type`` checked: refused here in one line."""
    for dest, value in vars(parsed).items():
        empty = value == [] and parser.get_default(dest) != []
        if empty or (isinstance(value, list) and [] in value):
            typed = next((token for token in argv if token.startswith("-") and token.endswith("--") and token != "--"),
                         "--")
            raise UsageError(f"{typed} gives its option no value ('--' ends the options): write a value after it")
    return parsed


class OptionSplitter:
    """Splits ``-o --limit 2GiB x = f()`` into its options and the statement that follows them.

    The parser owns the option list: whether an option takes a value is asked of it through
    ``parse_known_args`` (public argparse), once per option string, so an option added with ``@argument``
    (or an abbreviation argparse accepts) is split right with no second list to keep.
    """

    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser
        self._takes_value: dict[str, bool] = {}

    def takes_value(self, option: str) -> bool:
        """Whether ``option`` needs a value: alone it is refused, with one it parses. An unknown or
        ambiguous option takes none here; the parser says what is wrong with it when the options are parsed."""
        known = self._takes_value.get(option)
        if known is None:
            known = not self._parses([option]) and self._parses([option, _PROBE_VALUE])
            self._takes_value[option] = known
        return known

    def _parses(self, argv: list[str]) -> bool:
        try:
            _, extra = self.parser.parse_known_args(argv)
        except (UsageError, SystemExit):  # IPython's parser raises UsageError; a plain one exits
            return False
        return not extra

    def split(self, line: str) -> tuple[str, str]:
        position = 0
        while True:
            match = _OPTION.match(line, position)
            if not match:
                break
            end = match.end()
            if self.takes_value(match.group(1)):
                value = _OPTION_VALUE.match(line, end)
                if value:
                    end = value.end()
            position = end
        return line[:position].strip(), line[position:].strip()


def expand_options(options: str, namespace: Mapping[str, object]) -> str:
    """``{x}`` and ``$x`` in the options (never in the code measured) expand from the user's namespace,
    as IPython expands a magic's line: ``%%cudamem --limit {cap}``. Left as written when they do not
    expand, as IPython leaves them."""
    if "{" not in options and "$" not in options:
        return options
    from IPython.utils.text import DollarFormatter

    try:
        return DollarFormatter().vformat(options, args=[], kwargs=dict(namespace))
    except Exception:
        return options


_OFF_WORDS = ("", "0", "off", "none")


MAX_SETTING_BYTES = 1 << 60
"""The largest size a setting takes (an exbibyte): past it a size is a typo, and no float holds it exactly."""


def size_setting(option: str, value: object, allowed: str, off_words: tuple[str, ...] = _OFF_WORDS) -> int | None:
    """The bytes of a size option (``None``: off, or 0); a ``TraitError`` naming ``option`` and what it takes.
    ``off_words``: the strings that mean off, where off means something."""
    size: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str):
        if value.strip().lower() in off_words:
            return None
        try:
            size = parse_size(value)
        except (CudaMemError, OverflowError):
            pass
    if size is None or not 0 <= size <= MAX_SETTING_BYTES:
        raise TraitError(f"{option} takes {allowed}; got {value!r}")
    return size or None


def positive_int(option: str, value: int, what: str) -> int:
    if isinstance(value, bool) or not 1 <= value <= MAX_COUNT:
        raise TraitError(f"{option} takes {what} (a whole number from 1 to {MAX_COUNT:,}); got {value!r}")
    return value


def count_option(what: str, least: int = 1) -> Callable[[str], int]:
    """An ``@argument`` ``type`` for a count typed as an option's value: ``whole_number``'s ASCII digits (``int``
    also takes ``"３"``, ``"٣"`` and ``"1_0"``), from ``least`` to ``MAX_COUNT``. argparse names the option in
    its one-line error: ``argument --last: takes a number of cells, ...``."""

    def count(text: str) -> int:
        number = whole_number(text)
        if number is None or not least <= number <= MAX_COUNT:
            raise argparse.ArgumentTypeError(
                f"takes {what}, a whole number from {least} to {MAX_COUNT:,} in digits 0-9; got {text!r}"
            )
        return number

    return count


def number_option(what: str) -> Callable[[str], float]:
    """An ``@argument`` ``type`` for a number typed as an option's value, in ASCII (``float`` also takes
    ``"１"``, ``"١"`` and ``"1_0"``, as ``count_option``'s ``int`` does); its range is the setting's check.
    argparse names the option in its one-line error: ``argument --interval: takes seconds, ...``."""

    def number(text: str) -> float:
        typed = text.strip()
        try:
            if typed.isascii() and "_" not in typed:
                return float(typed)
        except ValueError:
            pass
        raise argparse.ArgumentTypeError(f"takes {what}, a number in digits 0-9 such as 0.5 or 2; got {text!r}")

    return number


class Float(traitlets.Float):
    """traitlets' ``Float``, which names the setting for an int past what a float holds (``10**400``), where
    traitlets' own conversion says only "int too large to convert to float". Named as traitlets' is:
    ``%config CudaMem`` shows each setting's class (``<Float>``)."""

    def validate(self, obj: Any, value: Any) -> float:
        try:
            return float(super().validate(obj, value))
        except OverflowError:
            raise TraitError(f"{type(obj).__name__}.{self.name} takes a number a float holds; got "
                             f"{shown_number(value)}") from None
