"""The checks of ``%oomfix``'s options, in one place: the magic's flags and its ``%config`` traits call these.

Each raises ``CudaMemError`` with one line naming what is allowed, so a bad value reads the same
whichever way it was given.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import CudaMemError
from .strategies import STRATEGIES


def check_max_tries(value: object) -> int:
    """``value`` as a number of reruns: a whole number, at least 1."""
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            as_int = int(str(value).strip())
        except ValueError:
            raise CudaMemError(f"max_tries must be a whole number of reruns, at least 1; got {value!r}") from None
        value = as_int
    if value < 1:
        raise CudaMemError(f"max_tries must be at least 1 (a whole number of reruns); got {value}")
    return value


def check_strategies(names: str | Iterable[str] | None) -> tuple[str, ...]:
    """Strategy names in the order given, duplicates dropped: a comma-separated string or a sequence.
    ``None``, ``""`` or ``"all"`` mean all of them (``cleanup, batch, autocast``)."""
    if names is None:
        return tuple(STRATEGIES)
    parts = names.replace(" ", ",").split(",") if isinstance(names, str) else [str(n) for n in names]
    chosen: list[str] = []
    for part in parts:
        name = part.strip().lower()
        if not name:
            continue
        if name == "all" and isinstance(names, str) and names.strip().lower() == "all":
            return tuple(STRATEGIES)
        if name not in STRATEGIES:
            raise CudaMemError(
                f"unknown strategy {part.strip()!r}; choose from {', '.join(STRATEGIES)} (comma-separated)"
            )
        if name not in chosen:
            chosen.append(name)
    return tuple(chosen) or tuple(STRATEGIES)
