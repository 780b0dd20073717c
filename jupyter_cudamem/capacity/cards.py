"""The table of common cards, in one place, and what a plan may use of each.

Sizes are the vendors' nominal memory, which NVIDIA writes as "GB" but means binary: a "16 GB" T4
carries 16 GiB (16 x 2^30 bytes) of GDDR6, and ``nvidia-smi`` shows an A100 40GB as 40960 MiB. So
the table is in **GiB**. The H200's "141 GB" is the one exception to the pattern: its six HBM3e stacks
hold 144 GiB of which NVIDIA exposes about 140.4 GiB; the table keeps the vendor's 141.

Two reservations stand between the nominal figure and what CUDA reports as the card's total:

- **ECC on GDDR memory.** Data-centre GDDR cards (T4, A10G, L4, L40S) run with ECC on by default,
  and on GDDR, ECC takes 1/16 of the memory for check bits: a T4 reports 15 GiB (15360 MiB), an L4
  or A10G about 22.5 GiB. HBM cards (V100, A100, H100, H200) keep ECC bits beside the data and lose
  nothing; consumer cards (RTX 3090, RTX 4090) ship with ECC off. The table subtracts the 1/16 where
  ECC is on by default (``ecc=True``); a card whose owner turned ECC off has that much more.
- **The driver and firmware** keep a further 0.5-1.7% (an H100 80GB HBM3 reports about 79.2 GiB to
  CUDA). That is not subtracted per card (it differs by card, driver and MIG mode): the plan's
  margin (``DEFAULT_MARGIN`` in ``plan``) covers it together with the allocator's rounding.

What the CUDA context and libraries take is not in this table either: it is measured on the machine
the plan runs on (see ``plan.non_pytorch_bytes``), not assumed.

``%config CudaMem.cards = {...}`` extends or overrides the table (``card_table``): a value is a size
(a number is GiB, a string such as ``"48GiB"`` or ``"46068MiB"`` is parsed), or a dict
``{"memory": size, "ecc": bool}``; ``None`` removes a card.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..errors import CudaMemError
from ..units import GiB, SizeTooLarge, number_in, parse_size


ECC_FRACTION = 1 / 16
"""Share of GDDR memory that ECC check bits take when ECC is on (one bit in 16)."""

MIN_CARD_GIB = 1.0
MAX_CARD_GIB = 16384.0
"""A card of the table holds 1 GiB to 16 TiB: below, the CUDA context alone fills it (no plan can use it);
above, no card is near (the largest of the table has 141 GiB)."""


@dataclass(frozen=True)
class Card:
    """One card: its name, nominal memory in GiB, and whether ECC (on GDDR) is on by default."""

    name: str
    nominal_gib: float
    ecc: bool = False

    @property
    def total_bytes(self) -> int:
        """Memory left after ECC's share: the card's total before the driver and the CUDA context."""
        share = ECC_FRACTION if self.ecc else 0.0
        return int(self.nominal_gib * GiB * (1 - share))


BUILTIN_CARDS: tuple[Card, ...] = (
    Card("T4", 16, ecc=True),
    Card("L4", 24, ecc=True),
    Card("A10G", 24, ecc=True),
    Card("RTX 3090", 24),
    Card("RTX 4090", 24),
    Card("V100 16GB", 16),
    Card("V100 32GB", 32),
    Card("A100 40GB", 40),
    Card("A100 80GB", 80),
    Card("L40S", 48, ecc=True),
    Card("H100 80GB", 80),
    Card("H200 141GB", 141),
)


def _normal(name: str) -> str:
    return "".join(name.lower().split()).replace("-", "").replace("_", "")


def _card(name: str, value: object) -> Card:
    ecc = False
    memory = value
    if isinstance(value, Mapping):
        unknown = set(value) - {"memory", "ecc"}
        if unknown or "memory" not in value:
            raise CudaMemError(
                f"CudaMem.cards[{name!r}]: a dict takes 'memory' (GiB or a size such as '48GiB') and "
                f"optionally 'ecc' (True/False); got keys {sorted(value)}"
            )
        memory, ecc = value["memory"], bool(value.get("ecc", False))
    if isinstance(memory, bool) or not isinstance(memory, (int, float, str)):
        raise CudaMemError(
            f"CudaMem.cards[{name!r}] = {memory!r}: give the card's memory as GiB (24) or a size ('46068MiB')"
        )
    if isinstance(memory, str):
        try:
            gib = parse_size(memory) / GiB
        except SizeTooLarge:  # more than a float holds ('9' * 400 + 'GiB'): past the range, refused below
            gib = math.inf
        except CudaMemError as error:
            raise CudaMemError(f"CudaMem.cards[{name!r}]: {error}") from None
    else:
        gib = memory
    return Card(name, number_in(gib, f"CudaMem.cards[{name!r}]", MIN_CARD_GIB, MAX_CARD_GIB, "a card's memory in GiB"), ecc)


def card_table(extra: Mapping[str, object] | None = None) -> tuple[Card, ...]:
    """The built-in cards, overridden and extended by ``extra`` (``%config CudaMem.cards``).

    A name matching a built-in card (ignoring case, spaces and dashes) replaces it in place; a new
    name is added at the end; ``None`` removes the card.
    """
    cards = {_normal(card.name): card for card in BUILTIN_CARDS}
    if extra is None:
        return tuple(cards.values())
    if not isinstance(extra, Mapping):
        raise CudaMemError("CudaMem.cards must be a dict such as {'RTX 6000 Ada': 48}")
    for name, value in extra.items():
        if not isinstance(name, str) or not name.strip():
            raise CudaMemError(f"CudaMem.cards: a card's name must be a non-empty string, got {name!r}")
        key = _normal(name)
        if value is None:
            cards.pop(key, None)
            continue
        existing = cards.get(key)
        cards[key] = _card(existing.name if existing is not None else name.strip(), value)
    return tuple(cards.values())


def select_cards(table: Iterable[Card], names: str | None) -> tuple[Card, ...]:
    """The cards named in ``names`` (``"T4,A100 40GB"``), in that order; all of them when ``None``.

    A name matches a card exactly (ignoring case, spaces and dashes) or, failing that, as the one
    card whose name starts with it (``"v100"`` is ambiguous, ``"v100 32"`` is not).
    """
    cards = tuple(table)
    if names is None or not names.strip():
        return cards
    chosen: list[Card] = []
    for part in names.split(","):
        wanted = _normal(part)
        if not wanted:
            continue
        exact = [c for c in cards if _normal(c.name) == wanted]
        matches = exact or [c for c in cards if _normal(c.name).startswith(wanted)]
        if len(matches) != 1:
            known = ", ".join(c.name for c in cards)
            what = "matches several cards" if matches else "is not in the table"
            raise CudaMemError(
                f"--cards: {part.strip()!r} {what}; choose from {known} (add one with %config CudaMem.cards)"
            )
        if matches[0] not in chosen:
            chosen.append(matches[0])
    if not chosen:
        raise CudaMemError("--cards takes card names separated by commas, such as --cards T4,L4")
    return tuple(chosen)
