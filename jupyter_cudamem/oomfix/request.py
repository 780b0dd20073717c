"""What one ``%oomfix`` asks for, read once by the magic from the failed cell, its options and ``OomFix``'s
settings; the feature (``oomfix.fix``) reads nothing else of the magic."""

from __future__ import annotations

from dataclasses import dataclass

from ..oom import OomInfo
from .strategies import Strategy


@dataclass(frozen=True)
class FixRequest:
    """The failed cell and how to fix it. ``allocated_before``: what PyTorch had allocated on the OOM's
    device when the cell started (``None``: not known); ``ask``: ask before rerunning; ``limit_notes``: what
    the outcome says of the ``--limit`` cap the fix runs under."""

    source: str
    oom: OomInfo
    max_tries: int
    strategies: tuple[Strategy, ...]
    margin: float
    cell_number: int | None = None
    allocated_before: int | None = None
    delete: tuple[str, ...] = ()
    dry_run: bool = False
    ask: bool = True
    no_restore: bool = False
    apply: bool = False
    verbose: bool = False
    limit_notes: tuple[str, ...] = ()

    @property
    def cell_name(self) -> str:
        """How the outcome names the cell: ``In[k]`` where its number is known."""
        return "the cell" if self.cell_number is None else f"In[{self.cell_number}]"
