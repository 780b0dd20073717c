"""The card table and its %config extension (jupyter_cudamem/capacity/cards.py)."""

from __future__ import annotations

import pytest

from jupyter_cudamem.capacity.cards import BUILTIN_CARDS, ECC_FRACTION, Card, card_table, select_cards
from jupyter_cudamem.errors import CudaMemError

# Nothing here runs a library whose version `make test-min` changes (tests/versioned.py).
pytestmark = pytest.mark.dependency_free

GiB = 1024**3


def test_the_table_holds_the_issue_cards_in_gib():
    names = [card.name for card in BUILTIN_CARDS]
    for expected in ("T4", "L4", "A10G", "RTX 3090", "RTX 4090", "V100 16GB", "V100 32GB", "A100 40GB",
                     "A100 80GB", "L40S", "H100 80GB", "H200 141GB"):
        assert expected in names
    nominal = {card.name: card.nominal_gib for card in BUILTIN_CARDS}
    assert nominal["T4"] == 16 and nominal["A100 40GB"] == 40 and nominal["H200 141GB"] == 141
    assert nominal["L40S"] == 48 and nominal["V100 32GB"] == 32


def test_ecc_takes_a_sixteenth_of_gddr_cards_only():
    table = {card.name: card for card in BUILTIN_CARDS}
    assert table["T4"].total_bytes == 15 * GiB  # as nvidia-smi shows a T4: 15360 MiB
    assert table["L4"].total_bytes == int(24 * GiB * (1 - ECC_FRACTION))
    assert table["RTX 4090"].total_bytes == 24 * GiB
    assert table["A100 80GB"].total_bytes == 80 * GiB


def test_config_extends_overrides_and_removes():
    table = card_table({"RTX 6000 Ada": 48, "t-4": "15360MiB", "H200 141GB": None,
                        "Mine": {"memory": 32, "ecc": True}})
    by_name = {card.name: card for card in table}
    assert "H200 141GB" not in by_name
    assert by_name["RTX 6000 Ada"] == Card("RTX 6000 Ada", 48.0)
    assert by_name["T4"].total_bytes == 15 * GiB and not by_name["T4"].ecc  # the name kept, the value replaced
    assert [c.name for c in table].index("T4") == 0  # replaced in place
    assert by_name["Mine"].total_bytes == 30 * GiB
    assert [c.name for c in table][-2:] == ["RTX 6000 Ada", "Mine"]


@pytest.mark.parametrize("bad", [{"X": -1}, {"X": "lots"}, {"X": True}, {"X": {"gib": 3}}, {"": 3}, [("X", 3)]])
def test_bad_config_is_one_line(bad):
    with pytest.raises(CudaMemError) as error:
        card_table(bad)
    assert "\n" not in str(error.value) and "CudaMem.cards" in str(error.value)


def test_select_cards_by_name_or_unique_prefix():
    assert [c.name for c in select_cards(BUILTIN_CARDS, "a100 40gb, T4")] == ["A100 40GB", "T4"]
    assert [c.name for c in select_cards(BUILTIN_CARDS, "H100")] == ["H100 80GB"]
    assert [c.name for c in select_cards(BUILTIN_CARDS, "v100 32")] == ["V100 32GB"]
    assert select_cards(BUILTIN_CARDS, None) == BUILTIN_CARDS
    with pytest.raises(CudaMemError, match="matches several cards"):
        select_cards(BUILTIN_CARDS, "V100")
    with pytest.raises(CudaMemError, match="not in the table"):
        select_cards(BUILTIN_CARDS, "TPU")
