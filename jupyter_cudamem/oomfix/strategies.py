"""The ways a cell that ran out of GPU memory can be made to fit, in the order the driver tries them:
``cleanup`` (rerun unchanged, only where the cleanup freed what the failed allocation lacked), ``batch``
(the largest batch that fits, changed where it lives) and ``autocast`` (bfloat16 where the card has it).
"""

from __future__ import annotations

from enum import StrEnum


class Strategy(StrEnum):
    """A way to make the cell fit, named as ``--strategy`` takes it; members in the order they are tried."""

    CLEANUP = "cleanup"
    BATCH = "batch"
    AUTOCAST = "autocast"


STRATEGIES: tuple[Strategy, ...] = tuple(Strategy)
# Each strategy as a try's row names it.
STRATEGY_TITLES: dict[Strategy, str] = {
    Strategy.CLEANUP: "cleanup alone",
    Strategy.BATCH: "smaller batch",
    Strategy.AUTOCAST: "autocast",
}
