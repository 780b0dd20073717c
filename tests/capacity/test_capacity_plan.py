"""The planning arithmetic: usable memory, largest batch, exact accumulation, the line and its checks."""

from __future__ import annotations

import random

import pytest

from jupyter_cudamem.capacity.cards import Card
from jupyter_cudamem.growth.line import faster_than_linear, line_through, same
from jupyter_cudamem.capacity.plan import (
    Run,
    build_plan,
    largest_batch,
    plan_card,
    usable_bytes,
)
from jupyter_cudamem.growth.line import Line

GiB, MiB = 1024**3, 1024**2


def _card(name: str, nominal_gib: float) -> tuple[str, int]:
    """A card as the plan takes it: its name and the bytes it holds (``Card.total_bytes``)."""
    return name, Card(name, nominal_gib).total_bytes


def test_usable_is_card_less_outside_less_margin():
    assert usable_bytes(16 * GiB, GiB, 0.0) == 15 * GiB
    assert usable_bytes(16 * GiB, GiB, 0.1) == int(15 * GiB * 0.9)
    assert usable_bytes(GiB, 2 * GiB, 0.1) == 0


def test_largest_batch_is_the_last_that_fits():
    line = Line(10 * MiB, 2 * GiB)
    usable = 6 * GiB
    # (6 GiB - 2 GiB) / 10 MiB = 4,096 / 10 = 409.6: 409 samples (2 GiB + 4,090 MiB) fit, 410 (4,100 MiB) do not.
    assert largest_batch(line, usable) == 409
    assert largest_batch(line, GiB) == 0
    with pytest.raises(ValueError):
        largest_batch(Line(0, GiB), usable)


# 10 MiB a sample on 16 GiB (16,384 MiB). Room above the fixed part: 15,872 MiB for 0.5 GiB, 12,288 for 4,
# 6,144 for 10; without a margin room / 10 (1,587.2, 1,228.8, 614.4), with 4% of the room 0.96 x room / 10
# (1,523.7, 1,179.6, 589.8). The old rule took 4% of the whole card: (15,728.64 MiB - fixed) / 10 = 1,521.7,
# 1,163.3, 548.9.
@pytest.mark.parametrize(("fixed_gib", "full", "planned", "old"),
                         [(0.5, 1587, 1523, 1521), (4, 1228, 1179, 1163), (10, 614, 589, 548)])
def test_the_margin_costs_the_same_share_of_the_batch_whatever_the_fixed_part(fixed_gib, full, planned, old):
    """The margin is taken from the room above the fixed part: the plan's batch is 1 - margin of the
    line's largest batch on every card, so "never above by more than the margin" holds in batch terms;
    a margin taken from the whole card would cost a cell with a large fixed part a larger share."""
    line = Line(10 * MiB, int(fixed_gib * GiB))
    usable = 16 * GiB
    assert largest_batch(line, usable) == full
    assert largest_batch(line, usable, 0.04) == planned
    # what the old rule (4% of the whole) would give: a larger share lost as the fixed part grows
    assert largest_batch(line, usable * 0.96) == old


def test_a_reserved_line_that_needs_more_than_the_margin_decides():
    """A card limits what PyTorch reserves: where the reserved line leaves fewer samples than the
    allocated line with its margin, it decides; where it is within the margin, the allocated line does."""
    # 15 GiB = 15,360 MiB. Allocated with 4%: (15,360 - 1,024) x 0.96 / 20 = 688.1, so 688. Reserved (its
    # margin is what 4% stands for, so none more): (15,360 - 1,075.2) / 23 = 621.1, so 621; thrifty:
    # (15,360 - 1,034.24) / 20.2 = 709.2, more than 688.
    line = Line(20 * MiB, GiB)
    wasteful = Line(20 * MiB * 1.15, GiB * 1.05)  # 15% more reserved than allocated per sample
    card = plan_card(("16 GiB", 15 * GiB), line, None, 64, 0, 0.04, reserved_line=wasteful)
    assert card.largest_batch == 621
    thrifty = Line(20 * MiB * 1.01, GiB * 1.01)  # 1%: within the margin
    card = plan_card(("16 GiB", 15 * GiB), line, None, 64, 0, 0.04, reserved_line=thrifty)
    assert card.largest_batch == 688
    # A T4 with ECC on keeps 15/16 of its 16 GiB: the same 15 GiB.
    plan = build_plan([], 64, "b", [Card("T4", 16, ecc=True)], 0.04, 0, "x", line=line, reserved_line=wasteful)
    assert plan.predicted["T4"] == 621 and "reserved by PyTorch's cache" in plan.text()


def test_card_plan_for_a_batch_that_does_not_fit():
    line = Line(100 * MiB, 2 * GiB)
    plan = plan_card(_card("Small", 8), line, None, 256, 512 * MiB, 0.0)
    # (8,192 MiB - 512 - 2,048) / 100 = 56.32: 56 fit, not 256; 32 divides 256 and is at least half of 56.
    assert plan.largest_batch == 56 and not plan.fits
    assert (plan.micro_batch, plan.steps) == (32, 8)
    assert "accumulation steps" in plan.advice(256) and "chunks" in plan.advice(256, trains=False)


def test_a_prime_batch_says_no_divisor_is_close():
    line = Line(100 * MiB, 2 * GiB)
    plan = plan_card(_card("Small", 8), line, None, 257, 512 * MiB, 0.0)
    # 56 fit ((8 GiB - 512 MiB - 2 GiB) / 100 MiB = 56.3); 257 is prime, so no divisor is within half of 56:
    # four steps of 56 and a last of 33 (257 - 224), the same rule as %oomfix's advice (growth.accumulation).
    assert (plan.largest_batch, plan.micro_batch, plan.steps, plan.last_batch) == (56, 56, 5, 33)
    assert not plan.divisor_close and "no divisor of 257 is close" in plan.advice(257)
    assert "the last of 33" in plan.advice(257) and "to 280" in plan.advice(257)


def test_the_plan_and_oomfix_advice_split_a_batch_by_one_rule():
    from jupyter_cudamem.advice import accumulation_plan as advice_rule

    # 56 fit; 32 divides 256 and is at least half of 56: eight equal steps of 32 in both features.
    line = Line(100 * MiB, 2 * GiB)
    plan = plan_card(_card("Small", 8), line, None, 256, 512 * MiB, 0.0)
    assert (plan.micro_batch, plan.steps, plan.last_batch) == (32, 8, None) and plan.divisor_close
    advice = advice_rule(256, 56)
    assert (advice.micro, advice.steps, advice.exact) == (32, 8, True)


def test_a_card_too_small_for_the_fixed_part():
    plan = plan_card(_card("Tiny", 2), Line(MiB, 3 * GiB), None, 8, 0, 0.0)
    assert plan.largest_batch == 0 and not plan.fits and plan.micro_batch is None
    assert "even at batch 1" in plan.advice(8)


def test_fixed_size_cell_fits_or_not():
    runs = [Run("as written", None, 10 * GiB, GiB)]
    plan = build_plan(runs, None, None, [Card("Big", 16), Card("Small", 8)], 0.04, 512 * MiB, "measured")
    assert plan.line is None and plan.fixed_bytes == 10 * GiB
    assert [c.fits for c in plan.cards] == [True, False]
    assert plan.predicted == {"Big": None, "Small": None}
    assert "fixed-size" in plan.text()


def test_fit_recovers_a_line_and_judges_it():
    line = line_through([(32, 2 * GiB + 32 * 7 * MiB), (64, 2 * GiB + 64 * 7 * MiB)])
    assert line.slope_bytes == pytest.approx(7 * MiB) and line.intercept_bytes == pytest.approx(2 * GiB)
    assert not faster_than_linear(line, start_bytes=2 * GiB, peak_bytes=2 * GiB + 64 * 7 * MiB)
    quadratic = lambda b: GiB + 4 * MiB * b + 0.2 * MiB * b * b  # noqa: E731
    curved = line_through([(32, int(quadratic(32))), (64, int(quadratic(64)))])
    assert faster_than_linear(curved, start_bytes=GiB, peak_bytes=int(quadratic(64)))
    with pytest.raises(ValueError):
        line_through([(64, GiB), (64, GiB)])


def test_same_allows_small_noise_only():
    assert same(2 * GiB, 2 * GiB + MiB, start_bytes=GiB)
    assert not same(2 * GiB, 2 * GiB + 200 * MiB, start_bytes=GiB)


def test_plan_object_text_html_and_predicted():
    line = Line(10 * MiB, GiB)
    runs = [Run("smaller", 32, GiB + 32 * 10 * MiB, GiB), Run("as written, again", 64, GiB + 64 * 10 * MiB, GiB)]
    plan = build_plan(runs, 64, "batch_size", [Card("T4", 16, ecc=True), Card("Big", 80)], 0.04, 512 * MiB,
                      "measured here through NVML", this_card=("Fake", 40 * GiB), line=line)
    assert plan.per_sample_bytes == 10 * MiB and plan.fixed_bytes == GiB
    # The T4 keeps 15 GiB with ECC: (15,360 MiB - 512 - 1,024) x 0.96 / 10 = 1,327.1, so 1,327.
    assert plan.predicted["T4"] == 1327
    text = plan.text()
    assert "batch_size = 64" in text and "measured here through NVML" in text and "this card (Fake)" in text
    html = plan._repr_html_()
    assert "<table" in html and "data:image/png;base64," in html
    assert repr(plan) == text


def test_every_number_of_the_plan_comes_from_the_same_limits():
    # Allocated: 2 GiB + 100 MiB a sample; reserved: 2 GiB + 125 MiB (the allocator wastes a fifth per sample).
    # On an 8 GiB card with 512 MiB outside PyTorch the room above the fixed part is 5,632 MiB: the
    # allocated line with 4% allows 54 (5,632 x 0.96 / 100 = 54.07), the reserved line 45 (5,632 / 125 =
    # 45.06), which decides. --margin 0.10 leaves 6% more free below the reserved line: 5,632 x 0.94 / 125 =
    # 42.35, so 42 (it used to stay 45 while the text said 10%).
    line, reserved = Line(100 * MiB, 2 * GiB), Line(125 * MiB, 2 * GiB)
    card = _card("Small", 8)
    assert plan_card(card, line, None, 256, 512 * MiB, 0.04, reserved_line=reserved).largest_batch == 45
    assert plan_card(card, line, None, 256, 512 * MiB, 0.10, reserved_line=reserved).largest_batch == 42
    # Autocast halves the per-sample bytes (50 MiB): by the allocated line alone 108 (5,632 x 0.96 / 50),
    # but its runs waste what the float32 runs wasted: 62.5 MiB a sample reserved, 5,632 / 62.5 = 90.1, so 90.
    autocast = Line(50 * MiB, 2 * GiB)
    plan = plan_card(card, line, None, 256, 512 * MiB, 0.04, autocast_line=autocast, reserved_line=reserved)
    assert plan.largest_autocast_batch == 90


def test_the_autocast_column_scales_the_float32_column_by_the_per_sample_bytes():
    # The notebook's T4: float32 80 MiB + 16 MiB a sample, autocast 10 MiB a sample (-38%), and the
    # allocator's replay deciding the float32 column: 892. The same room holds 892 x 16 / 10 = 1,427.2
    # samples under autocast, so 1,427, above 892 (it used to take the reserved line's waste the replay
    # had not, and came out below float32).
    line, autocast, reserved = Line(16 * MiB, 80 * MiB), Line(10 * MiB, 80 * MiB), Line(32 * MiB, 80 * MiB)
    plan = plan_card(_card("T4", 16), line, None, 256, 760 * MiB, 0.1, autocast_line=autocast,
                     reserved_line=reserved, replayed=lambda usable: 892)
    assert (plan.largest_batch, plan.largest_autocast_batch) == (892, 1427)
    # Calibrated by 1.25 on an 8 GiB card with 512 MiB outside PyTorch: 125 MiB + 2.5 GiB a sample leaves
    # 5,120 MiB of room, 5,120 x 0.96 / 125 = 39.3, so 39; under autocast 39 x 100 / 50 = 78.
    line, autocast = Line(100 * MiB, 2 * GiB), Line(50 * MiB, 2 * GiB)
    plan = plan_card(_card("Small", 8), line, None, 256, 512 * MiB, 0.04, autocast_line=autocast, ratio=1.25)
    assert (plan.largest_batch, plan.largest_autocast_batch) == (39, 78)
