"""The ways a cell that ran out of GPU memory can be made to fit, in the order the driver tries them.

- ``cleanup``: rerun the cell unchanged once what the failure left behind is freed. Tried only when
  cleanup freed enough to matter (at least the allocation that failed) or the failure looked like
  fragmentation; otherwise the rerun would fail the same way and is skipped, with the reason.
- ``batch``: find where the batch size lives (``jupyter_cudamem.batch``), and search for the largest
  that fits (``batchsearch.policy.BatchSearch``), changing only it.
- ``autocast``: run the cell under ``torch.autocast("cuda", dtype=...)``, bfloat16 where the card
  supports it, else float16 (then a GradScaler is needed to train).

The driver (``driver.py``) runs them; each try is recorded in ``outcome.TryResult``, the whole fix in
``outcome.Outcome``; the advice that follows is ``jupyter_cudamem.advice``'s.
"""

from __future__ import annotations

from enum import StrEnum

from ..sources.torch_device import default_autocast_dtype

__all__ = ["STRATEGIES", "STRATEGY_TITLES", "Strategy", "default_autocast_dtype"]


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
