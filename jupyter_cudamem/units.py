"""Sizes in bytes, parsed from and formatted for people, in one place.

Binary units (KiB, MiB, GiB, TiB) are powers of 1024 and decimal ones (KB, MB, GB, TB) powers of
1000, as in the SI and in ``nvidia-smi``'s MiB. A bare number is bytes.
"""

from __future__ import annotations

import math
import re

from .errors import CudaMemError

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4

# The one table of unit names (lower case) to bytes: people's sizes here, and the sizes in PyTorch's
# and other libraries' error messages (``oom``: "0 bytes", "3.19 MiB").
UNIT_FACTORS = {
    "": 1,
    "b": 1,
    "bytes": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "pib": 1024**5,
}
_FACTORS = UNIT_FACTORS

class SizeTooLarge(CudaMemError):
    """A size past what a float holds (``"9" * 400 + "GiB"``): a setting with a range names its range instead."""


_SIZE_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int | float) -> int:
    """Return the number of bytes in ``text`` such as ``"24GiB"``, ``"1.5 GB"`` or ``"4096"``."""
    if isinstance(text, bool):
        raise CudaMemError(f"not a size: {text!r}; write a size such as 24GiB or 512MiB")
    if isinstance(text, (int, float)):
        value, unit = as_float(text), ""
        if not math.isfinite(value):
            raise CudaMemError(f"not a size: {shown_number(text)}; write a size such as 24GiB or 512MiB")
    else:
        match = _SIZE_PATTERN.match(str(text))
        if not match:
            raise CudaMemError(f"not a size: {text!r}; write a size such as 24GiB or 512MiB")
        value, unit = float(match.group(1)), match.group(2).lower()
    if unit not in _FACTORS:
        raise CudaMemError(
            f"unknown size unit {unit!r} in {text!r}; use B, KiB, MiB, GiB, TiB (or KB, MB, GB, TB)"
        )
    scaled = value * _FACTORS[unit]
    if not math.isfinite(scaled):  # more digits than a float holds (400 nines)
        typed = str(text).strip()
        shown = typed if len(typed) <= 40 else f"{typed[:12]}…{typed[-8:]} ({len(typed):,} characters)"
        raise SizeTooLarge(f"size too large: {shown}; write a size such as 24GiB or 512MiB")
    size = int(round(scaled))
    if size <= 0:
        raise CudaMemError(f"size must be positive, got {text!r}")
    return size


def format_bytes(size: int | float | None, signed: bool = False) -> str:
    """Format ``size`` bytes with a binary unit, e.g. ``1.50 GiB``; ``signed`` adds ``+`` to gains."""
    if size is None:
        return "n/a"
    sign = ""
    if size < 0:
        sign = "-"
    elif signed and size > 0:
        sign = "+"
    magnitude = abs(float(size))
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    step = 0
    while magnitude >= 1024 and step < len(units) - 1:
        magnitude /= 1024
        step += 1
    if step == 0:
        return f"{sign}{int(magnitude)} B"
    return f"{sign}{magnitude:.2f} {units[step]}"


def format_seconds(seconds: float) -> str:
    """Format a duration for a report: ``850 ms``, ``3.21 s``, ``2 min 5 s``."""
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.2f} s"
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes} min {rest} s"


def number_in(value: object, name: str, low: float, high: float, what: str) -> float:
    """``value`` as a float from ``low`` to ``high`` (both included), else a ``CudaMemError`` naming ``name``.

    The one check of the numbers people type or set: NaN, infinities and numbers out of range are refused
    where they are given, not found later as an ``OverflowError`` in a wait or a division by zero in a figure.
    """
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise CudaMemError(f"{name} takes {what} from {low:g} to {high:g}; got {value!r}")
    # An int is compared as it is: one past a float's range (10**400) has no float to check.
    within = low <= value <= high if isinstance(value, int) else math.isfinite(value) and low <= value <= high
    if not within:
        raise CudaMemError(f"{name} takes {what} from {low:g} to {high:g}; got {shown_number(value)}")
    return float(value)


def as_float(value: float) -> float:
    """``value`` as a float; an int past a float's range (``10**400``) as the infinity of its sign, which the
    checks of finite numbers then refuse, where ``float()`` raises ``OverflowError``."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def shown_number(value: float) -> str:
    """``value`` as a setting's error writes it: ``%g``, or its power of ten past a float's range."""
    try:
        return f"{value:g}"
    except OverflowError:
        return f"about {'-' if value < 0 else ''}1e+{int(math.log10(abs(value)))}"


MAX_COUNT = 2**31 - 1
"""The largest count a setting or option takes (the history's length, the trace's events, reruns): what a
C int holds."""


def whole_number(text: str) -> int | None:
    """``text`` as a whole number of ASCII digits (``"12"``), else ``None``. ``str.isdigit`` accepts ``"²"``
    (which ``int`` refuses), ``int`` accepts ``"١٢"`` and ``"1_0"``: an option's number is neither. ``None``
    too for more digits than ``int`` converts from text (``sys.get_int_max_str_digits``)."""
    text = text.strip()
    if not (text.isascii() and text.isdecimal()):
        return None
    try:
        return int(text)
    except ValueError:
        return None
