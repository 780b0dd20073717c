"""Where this process stands in a ``torch.distributed`` job: the only module that asks it.

Engines of one cluster that train together (DDP, FSDP) each have a rank; the engines table shows it so a
row can be read as "rank 3", not only "engine 5". Asking never imports torch nor starts anything: a process
that has not imported ``torch.distributed`` and initialised a process group has no rank.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Rank:
    rank: int
    world_size: int


def current_rank() -> Rank | None:
    """This process's rank and the world's size, or ``None`` where no process group is initialised."""
    distributed = sys.modules.get("torch.distributed")
    if distributed is None:
        return None
    try:
        if not (distributed.is_available() and distributed.is_initialized()):
            return None
        return Rank(rank=int(distributed.get_rank()), world_size=int(distributed.get_world_size()))
    except (RuntimeError, ValueError, AttributeError):  # a group torn down under us: no rank to show
        return None
