"""Which card does a cell need? A capacity plan from measured memory (``%%cudamem_plan``).

``runs`` runs a cell at its batch and a smaller one and measures each run; ``fit`` draws the line
``peak = fixed + per sample x batch`` and says how well the runs agree with it; ``cards`` holds the
table of common cards; ``prediction`` turns the line and the memory measured outside PyTorch into the
largest batch per card, with gradient accumulation for a batch that does not fit; ``plan`` builds the plan
from the runs, and ``render`` and ``figure`` show it. Knows nothing of IPython.
"""

from .cards import BUILTIN_CARDS, Card, card_table, select_cards
from .plan import DEFAULT_MARGIN, CapacityPlan, CardPlan, Run, build_plan, largest_batch, usable_bytes

__all__ = [
    "BUILTIN_CARDS",
    "DEFAULT_MARGIN",
    "CapacityPlan",
    "Card",
    "CardPlan",
    "Run",
    "build_plan",
    "card_table",
    "largest_batch",
    "select_cards",
    "usable_bytes",
]
