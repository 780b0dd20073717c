"""The checks of ``%oomfix``'s options, for its flags and its ``%config`` traits alike: each raises
``CudaMemError`` with one line naming what is allowed, so a bad value reads the same whichever way it came.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import CudaMemError
from ..units import MAX_COUNT, whole_number
from .strategies import STRATEGIES, Strategy


def check_max_tries(value: object) -> int:
    """``value`` as a number of reruns: a whole number from 1 to ``MAX_COUNT``."""
    if isinstance(value, bool) or not isinstance(value, int):
        as_int = whole_number(str(value))
        if as_int is None:
            raise CudaMemError(f"max_tries must be a whole number of reruns, at least 1; got {value!r}")
        value = as_int
    if value < 1:
        raise CudaMemError(f"max_tries must be at least 1 (a whole number of reruns); got {value}")
    if value > MAX_COUNT:
        raise CudaMemError(f"max_tries must be at most {MAX_COUNT:,} reruns; got more")
    return value


def check_deletable(names: Iterable[str]) -> None:
    """``--del``'s names, before anything is freed: one IPython's ``del_var`` would refuse to delete (it raises
    ``ValueError``) is one line here."""
    refused = next((name for name in names if name in ("__builtins__", "__builtin__")), None)
    if refused is not None:
        raise CudaMemError(f"--del {refused}: IPython never deletes it (the shell needs it); nothing was deleted")


def check_strategies(names: str | Iterable[str] | None) -> tuple[Strategy, ...]:
    """The strategies named, in the order given, duplicates dropped: a comma-separated string or a sequence.
    ``None``, ``""`` or ``"all"`` mean all of them (``cleanup, batch, autocast``). The one place where the
    user's text (``--strategy``, ``OomFix.strategies``) becomes ``Strategy``."""
    if names is None:
        return STRATEGIES
    parts = names.replace(" ", ",").split(",") if isinstance(names, str) else [str(n) for n in names]
    chosen: list[Strategy] = []
    for part in parts:
        name = part.strip().lower()
        if not name:
            continue
        if name == "all" and isinstance(names, str) and names.strip().lower() == "all":
            return STRATEGIES
        try:
            strategy = Strategy(name)
        except ValueError:
            raise CudaMemError(
                f"unknown strategy {part.strip()!r}; choose from {', '.join(STRATEGIES)} (comma-separated)"
            ) from None
        if strategy not in chosen:
            chosen.append(strategy)
    return tuple(chosen) or STRATEGIES
